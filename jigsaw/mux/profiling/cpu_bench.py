"""The CPU side of `jigsaw profile`: the recipe's model, its sub-stage kinds, on core sets.

    ProfileConfig(device="cpu") ─► CpuBench(load_model): two worker processes (spawn), each
        with the model load_model() returns and one kernel per kind
            rollout_prefill  forward of a prompt batch (no cache)
            rollout_decode   one decode step of a large batch over its KV cache (cropped back)
            rollout_tail     one decode step of 2 long requests
            reference        forward of a micro-batch, no grad
            training         forward + backward of a micro-batch
        alone(k, σ, m):   worker 0 bound to split_cores(σ)[0] (all cores for σ = 1)
        pair(a, b, σ, m): worker 0 on one side, worker 1 on the other, same wall window
                          (σ = 1.0: both on every core, the OS time-shares them)
        one core (a device per core, `--cores 0`): it cannot be split, so σ = 0.5 is the fair
            half two time-sharing processes get: alone(k, 0.5) beside a busy spinner, a pair
            both on the core
        ─► seconds per token; the levels are the shares a core split can give (cpu_levels)

One memory level, 0.5 each side: a CPU's memory is not partitioned.  Every process allocates
what it needs and the CPU engines do not size a batch by a grant, so a grid that slowed a
kind down at a smaller memory share would describe batches that never run (an earlier grid
did: decode 2.9× slower "at 20% of memory", a batch no CPU engine here ever shrinks to).

Processes, not threads: the GIL would serialise the Python side of the kernels, which is
exactly the overhead a CPU rollout has.  The caller hands the model loader in (`jigsaw
profile` loads the recipe's model with jigsaw.engines.model), so profiling never imports the
engines, which bind themselves with mux.partition: the dependency runs engines -> mux only.
"""

from __future__ import annotations

import multiprocessing as mp
import platform
import time
from collections.abc import Callable
from typing import Any

from jigsaw.mux.model.slowdown import DeviceInfo
from jigsaw.mux.partition.cpu import split_cores, usable_cores

KV_CONTEXT = {"rollout_decode": 64, "rollout_tail": 256}
BATCH_AT_TOP = {"rollout_prefill": 8, "rollout_decode": 32, "rollout_tail": 2, "reference": 16, "training": 8}
SEQ_TOKENS = 64
SPIN = "spin"
"""A busy partner (matmuls) that takes its time share of a core and nothing else."""


class CpuBench:
    mem_levels = (0.5,)
    """The memory levels it measures (the module docstring says why only one)."""

    def __init__(self, load_model: Callable[[], Any], min_time_s: float = 0.3, cores=None):
        """`load_model()` returns the torch model to profile; it runs in each spawned worker,
        so it must pickle (a module-level function, or a functools.partial of one)."""
        self.cores = tuple(cores or usable_cores())
        if not self.cores:
            raise ValueError("profiling a CPU device needs at least one core")
        self.min_time_s = min_time_s
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for _ in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, load_model), daemon=True)
            p.start()
            self.pipes.append(parent)
            self.procs.append(p)
        for pipe in self.pipes:
            _reply(pipe)  # model loaded
        self.device_info = _device_info(self.cores, self._peak_flops())

    def close(self) -> None:
        for pipe, p in zip(self.pipes, self.procs):
            if p.is_alive():
                pipe.send(("stop",))
            p.join(5)
            if p.is_alive():
                p.kill()

    def _peak_flops(self) -> float:
        self.pipes[0].send(("bind", self.cores))
        _reply(self.pipes[0])
        self.pipes[0].send(("matmul",))
        return _reply(self.pipes[0])

    def alone(self, kind: str, sm_frac: float, mem_frac: float) -> float:
        if sm_frac < 1.0 and len(self.cores) == 1:  # its time share of the one core: a spinner takes the rest
            return self._run([(0, kind, mem_frac, self.cores), (1, SPIN, 0.0, self.cores)])[0]
        cores = self.cores if sm_frac >= 1.0 else split_cores(self.cores, sm_frac)[0]
        return self._run([(0, kind, mem_frac, cores)])[0]

    def pair(self, kind_a: str, kind_b: str, sm_frac_a: float, mem_frac_a: float) -> tuple[float, float]:
        whole = sm_frac_a >= 1.0 or len(self.cores) == 1
        sides = (self.cores, self.cores) if whole else split_cores(self.cores, sm_frac_a)
        t = self._run([(0, kind_a, mem_frac_a, sides[0]), (1, kind_b, round(1.0 - mem_frac_a, 9), sides[1])])
        return t[0], t[1]

    def _run(self, jobs) -> list[float]:
        for w, _, _, cores in jobs:
            self.pipes[w].send(("bind", cores))
            _reply(self.pipes[w])
        start = time.time() + 0.05  # both begin together after their warm-up
        for w, kind, mem, _ in jobs:
            self.pipes[w].send(("run", kind, mem, start, self.min_time_s))
        return [_reply(self.pipes[w]) for w, *_ in jobs]


def _reply(pipe):
    msg = pipe.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(f"profile worker failed: {msg[1]}")
    return msg


def _device_info(cores, peak_flops: float) -> DeviceInfo:
    import psutil

    name = (platform.processor() or platform.machine() or "cpu").replace(" ", "-")
    return DeviceInfo(sku=f"CPU-{name}-{len(cores)}c", num_sms=len(cores), mem_bytes=psutil.virtual_memory().total,
                      peak_flops=peak_flops, mem_bw_bytes_per_s=1.0)


# ---------------------------------------------------------------- worker process

def _worker(pipe, load_model: Callable[[], Any]) -> None:
    try:
        import torch

        model = load_model()
        kernels: dict = {}
        pipe.send("ready")
        while (cmd := pipe.recv())[0] != "stop":
            if cmd[0] == "bind":
                from jigsaw.mux.partition.bind import Binder
                from jigsaw.mux.partition.partitioners import Cpu

                Binder().bind(Cpu(cores=tuple(cmd[1]), threads=len(cmd[1])))  # this process, threads follow
                pipe.send("ok")
            elif cmd[0] == "matmul":
                pipe.send(_matmul_flops(torch))
            else:
                _, kind, _mem, start, seconds = cmd  # one kernel per kind, whatever the memory share
                if kind not in kernels:
                    kernels[kind] = _kernel(torch, model, kind)
                pipe.send(_timed(kernels[kind], start, seconds))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))


def _matmul_flops(torch) -> float:
    """Measured fp32 matmul throughput on the bound cores: the CPU's practical peak."""
    a = torch.randn(1024, 1024)
    a @ a
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        a @ a
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - t0)


def _timed(kernel, start: float, seconds: float) -> float:
    step, tokens = kernel
    step()  # warm-up
    time.sleep(max(0.0, start - time.time()))
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    return (time.perf_counter() - t0) / (n * tokens)


def _kernel(torch, model, kind: str):
    if kind == SPIN:
        a = torch.randn(128, 128)
        return (lambda: a @ a), 1
    batch = BATCH_AT_TOP[kind]
    vocab = model.config.vocab_size
    if kind in KV_CONTEXT:
        return _decode(torch, model, batch, KV_CONTEXT[kind], vocab)
    ids = torch.randint(0, vocab, (batch, SEQ_TOKENS))
    if kind == "training":
        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
    else:
        def step():
            with torch.no_grad():
                model(input_ids=ids)
    return step, batch * SEQ_TOKENS


def _decode(torch, model, batch: int, context: int, vocab: int):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (batch, context)), past_key_values=cache, use_cache=True)
    nxt = torch.randint(0, vocab, (batch, 1))

    def step():
        with torch.no_grad():
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # steady state: drop the new token, so the context does not grow

    return step, batch

