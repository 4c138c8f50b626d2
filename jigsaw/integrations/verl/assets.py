"""What a verl GRPO job on this machine reads, made locally (no download).

    make_model(dir)    jigsaw's tiny Qwen3 (engines/model.py) + its offline tokenizer, with a
                       chat template, saved as an HF checkpoint verl and the rollout both load;
                       its output head is untied and peaked, and it says EOS where it would
                       first say one common token: most answers end early, a few run to the
                       cap (a long tail, from the model itself)
    make_gsm8k(dir)    train/test parquet files in verl's GSM8K layout (data_source
                       "openai/gsm8k", a chat prompt, the answer as `reward_model.ground_truth`
                       scored by verl's own gsm8k rule: "#### <number>")
    long_rows(model, n, min_tokens)
                       train rows whose greedy answer by that model runs to min_tokens or
                       more: a data set whose every rollout is long (tests that must catch
                       requests mid-generation pass them to make_gsm8k as train_rows)
"""

from __future__ import annotations

import random
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML, as Qwen's: verl's Qwen token builder needs <|im_end|> and a one-token newline."""
SHARPEN = 8.0
"""Scale of the input embedding: a random tiny model's hidden states are nearly flat otherwise."""
HEAD_STD = 2.0
"""Std of the untied output head's weights: logits peaked enough that float noise between
kernels (batching, thread counts) never flips a greedy choice.  A tied head makes a random
model repeat its last input token forever."""
EOS_PROBE = (8, 32)
"""(prompts, tokens) generated greedily to pick the token EOS stands in for."""
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def make_model(path: Path, *, seed: int = 0) -> Path:
    """Save the tiny Qwen3 and its tokenizer under `path` (once: an existing checkpoint is kept)."""
    import copy

    import torch

    from jigsaw.engines.model import ModelConfig, load

    path = Path(path)
    if (path / "config.json").exists():
        return path
    model, tok = load(ModelConfig(name="tiny-qwen3", seed=seed))
    tok = copy.deepcopy(tok)  # the offline tokenizer is cached per process: leave that one as it is
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    model.resize_token_embeddings(len(tok))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(SHARPEN)
        model.config.tie_word_embeddings = False
        model.lm_head = torch.nn.Linear(model.config.hidden_size, len(tok), bias=False)
        model.lm_head.weight.copy_(torch.randn(len(tok), model.config.hidden_size, generator=gen) * HEAD_STD)
        stand_in = _common_token(model, tok)
        # EOS wins exactly where the stand-in would have been said (peaked logits: the margin holds)
        model.lm_head.weight[tok.eos_token_id] = model.lm_head.weight[stand_in] * 1.05
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _common_token(model, tok) -> int:
    """The token that greedy answers to the train prompts say earliest while some never do."""
    import torch

    n_prompts, n_tokens = EOS_PROBE
    first: dict[int, list[int]] = {}
    for row in gsm8k_rows(n_prompts, seed=0, split="train"):
        ids = tok(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False))["input_ids"]
        out = model.generate(torch.tensor([ids]), max_new_tokens=n_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        for t in set(out) - {tok.eos_token_id}:
            first.setdefault(t, []).append(out.index(t))
    some = [(sorted(pos)[len(pos) // 2], t) for t, pos in first.items() if len(pos) < n_prompts]
    return min(some or [(0, max(first, key=lambda t: len(first[t])))])[1]


def gsm8k_rows(n: int, *, seed: int, split: str) -> list[dict]:
    """`n` arithmetic word problems in verl's GSM8K row layout."""
    rng = random.Random(f"{split}-{seed}")
    rows = []
    for i in range(n):
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
        question = f"Tom has {a} apples and buys {b} more, then gives away {c}. How many apples does he have?"
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b - c)},
                     "extra_info": {"split": split, "index": i, "question": question}})
    return rows


def make_gsm8k(path: Path, *, train: int = 64, test: int = 8, seed: int = 0,
               train_rows: list[dict] | None = None) -> tuple[Path, Path]:
    """train.parquet and test.parquet under `path` (`train_rows`, when given, are the train split)."""
    import pandas as pd

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    splits = {"train": train_rows or gsm8k_rows(train, seed=seed, split="train"),
              "test": gsm8k_rows(test, seed=seed, split="test")}
    for split, rows in splits.items():
        pd.DataFrame(rows).to_parquet(path / f"{split}.parquet")
    return path / "train.parquet", path / "test.parquet"


def long_rows(model: Path, n: int, *, min_tokens: int, seed: int = 0, candidates: int = 512) -> list[dict]:
    """`n` train rows (of the first `candidates`) whose greedy answer by the checkpoint at
    `model` has no EOS in its first `min_tokens` tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows, found = gsm8k_rows(candidates, seed=seed, split="train"), []
    for i in range(0, candidates, 32):
        batch = rows[i:i + 32]
        texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in batch]
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = lm.generate(**enc, max_new_tokens=min_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:]
        found += [r for r, ids in zip(batch, out.tolist()) if tok.eos_token_id not in ids[:min_tokens]]
        if len(found) >= n:
            return found[:n]
    raise ValueError(f"only {len(found)} of {candidates} prompts get an answer of {min_tokens}+ tokens "
                     f"from {model}; {n} were asked for")
