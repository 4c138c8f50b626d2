"""Sub-stage kernels for profiling: a decoder built from a model config, random weights.

    ModelSpec (jigsaw.mux.model.specs.MODELS or an HF config.json) + PriorConfig shapes + mem_frac
        ─► Decoder(num_layers=profile layers)  (RMSNorm, QKV/O, SwiGLU MLP, SDPA; bf16 on CUDA)
        ─► Kernel(kind): one iteration and the tokens it processes
              rollout_prefill  forward of `prefill_tokens` new tokens
              rollout_decode   one decode step of a large batch over its KV cache
              rollout_tail     one decode step of `tail_batch` long requests
              reference        forward of a micro-batch, no grad
              training         forward + backward of a micro-batch

Slowdowns are ratios of time per token, so a few layers stand for the whole model: every
layer is the same shape.  The memory share scales what memory buys: the decode batch (KV
pool) and the training / reference micro-batch; prefill and tail shapes do not depend on it.
No download: weights are random, only shapes matter for time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from jigsaw.mux.model.specs import MODELS, ModelSpec, PriorConfig, model_from_config

KINDS = ("rollout_prefill", "rollout_decode", "rollout_tail", "reference", "training")


def model_spec(model: str) -> tuple[str, ModelSpec]:
    """A shipped model name, or the path of an HF `config.json` (dense decoders)."""
    if model in MODELS:
        return model, MODELS[model]
    path = Path(model)
    if not path.is_file():
        raise ValueError(f"unknown model {model!r}: not one of {sorted(MODELS)} and not a config.json file")
    cfg = json.loads(path.read_text())
    return path.parent.name or path.stem, model_from_config({**cfg, "params": cfg.get("num_parameters", 0.0)},
                                                            str(path))


@dataclass(frozen=True, slots=True)
class Kernel:
    kind: str
    step: object
    """Callable running one iteration on the current stream."""
    tokens: int
    """Tokens one iteration processes (time per token is what the grid compares)."""


def build_kernels(spec: ModelSpec, shapes: PriorConfig, mem_frac: float, *, top_mem_frac: float, layers: int,
                  device: str, kinds: tuple[str, ...] = KINDS) -> dict[str, Kernel]:
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = _decoder(spec, layers, device, dtype)
    scale = mem_frac / top_mem_frac
    make = {"rollout_prefill": lambda: _prefill(model, spec, shapes, device, dtype),
            "rollout_decode": lambda: _decode(model, spec, max(1, round(shapes.decode_max_batch * scale)),
                                              shapes.decode_context_tokens, device, dtype, "rollout_decode"),
            "rollout_tail": lambda: _decode(model, spec, shapes.tail_batch, shapes.tail_context_tokens, device,
                                            dtype, "rollout_tail"),
            "reference": lambda: _micro_batch(model, spec, shapes, scale, device, dtype, train=False),
            "training": lambda: _micro_batch(model, spec, shapes, scale, device, dtype, train=True)}
    return {k: make[k]() for k in kinds}


def _decoder(spec: ModelSpec, layers: int, device: str, dtype):
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            h, d = spec.hidden_size, spec.head_dim
            self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
            self.qkv = nn.Linear(h, (spec.num_heads + 2 * spec.num_kv_heads) * d, bias=False)
            self.o = nn.Linear(spec.num_heads * d, h, bias=False)
            self.gate_up = nn.Linear(h, 2 * spec.intermediate_size, bias=False)
            self.down = nn.Linear(spec.intermediate_size, h, bias=False)

        def forward(self, x, kv=None):
            b, t, _ = x.shape
            d, nq, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
            q, k, v = self.qkv(self.norm1(x)).split([nq * d, nkv * d, nkv * d], dim=-1)
            q = q.view(b, t, nq, d).transpose(1, 2)
            k, v = (z.view(b, t, nkv, d).transpose(1, 2) for z in (k, v))
            if kv is not None:  # decode: the new token's K/V go into the cache's last slot, in place,
                kv[0][:, :, -1:].copy_(k)  # as an engine's paged cache does (a cat would allocate and copy
                kv[1][:, :, -1:].copy_(v)  # the whole cache every step)
                k, v = kv
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=kv is None, enable_gqa=True)
            x = x + self.o(att.transpose(1, 2).reshape(b, t, nq * d))
            g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(torch.nn.functional.silu(g) * u)

    return nn.ModuleList(Layer() for _ in range(layers)).to(device=device, dtype=dtype)


def _run(model, x, kvs=None):
    for i, layer in enumerate(model):
        x = layer(x, None if kvs is None else kvs[i])
    return x


def _prefill(model, spec, shapes, device, dtype) -> Kernel:
    import torch

    x = torch.randn(1, shapes.prefill_tokens, spec.hidden_size, device=device, dtype=dtype)

    @torch.no_grad()
    def step():
        _run(model, x)

    return Kernel("rollout_prefill", step, shapes.prefill_tokens)


def _decode(model, spec, batch: int, context: int, device, dtype, kind: str) -> Kernel:
    import torch

    x = torch.randn(batch, 1, spec.hidden_size, device=device, dtype=dtype)
    shape = (batch, spec.num_kv_heads, context + 1, spec.head_dim)  # the context, and a slot for the new token
    kvs = [(torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype))
           for _ in model]

    @torch.no_grad()
    def step():
        _run(model, x, kvs)

    return Kernel(kind, step, batch)


def _micro_batch(model, spec, shapes, scale, device, dtype, *, train: bool) -> Kernel:
    import torch

    full = shapes.train_micro_batch_tokens if train else shapes.ref_micro_batch_tokens
    tokens = max(shapes.train_min_micro_batch_tokens if train else 1, round(full * scale))
    seq = min(shapes.train_seq_tokens, tokens)
    x = torch.randn(max(1, math.ceil(tokens / seq)), seq, spec.hidden_size, device=device, dtype=dtype)

    def step():
        if train:
            _run(model, x).float().square().mean().backward()
        else:
            with torch.no_grad():
                _run(model, x)

    return Kernel("training" if train else "reference", step, x.shape[0] * x.shape[1])
