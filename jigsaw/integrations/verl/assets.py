"""What a verl GRPO job on this machine reads, made locally (no download).

    make_model(dir)    jigsaw's tiny Qwen3 (engines/model.py) + its offline tokenizer, with a
                       chat template, saved as an HF checkpoint verl and the rollout both load
    make_gsm8k(dir)    train/test parquet files in verl's GSM8K layout (data_source
                       "openai/gsm8k", a chat prompt, the answer as `reward_model.ground_truth`
                       scored by verl's own gsm8k rule: "#### <number>")
"""

from __future__ import annotations

import random
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML, as Qwen's: verl's Qwen token builder needs <|im_end|> and a one-token newline."""
SHARPEN = 8.0
"""Scale of the (tied) embedding: logits this many times sharper than at initialisation."""
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
    with torch.no_grad():  # peaked logits, as a trained model's: a random tiny model's are nearly flat,
        model.get_input_embeddings().weight.mul_(SHARPEN)  # and float noise between kernels flips greedy ties
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


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


def make_gsm8k(path: Path, *, train: int = 64, test: int = 8, seed: int = 0) -> tuple[Path, Path]:
    """train.parquet and test.parquet under `path`."""
    import pandas as pd

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out = []
    for split, n in (("train", train), ("test", test)):
        f = path / f"{split}.parquet"
        pd.DataFrame(gsm8k_rows(n, seed=seed, split=split)).to_parquet(f)
        out.append(f)
    return out[0], out[1]
