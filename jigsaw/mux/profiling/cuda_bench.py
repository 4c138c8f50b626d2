"""The CUDA side of `jigsaw profile`: sub-stage kernels on green-context partitions.

    ProfileConfig ─► CudaBench(gpu)
        GreenPartitions(gpu, σ ∈ sm_levels < 1): one disjoint (σ, 1−σ) pair of streams each
        kernels per memory level (kernels.py), built once and cached
        alone(k, σ, m):  k on the σ side of the pair (the whole device's stream for σ = 1)
        pair(a, b, σ, m): a on the σ side, b on the other, two host threads, same wall window;
                          σ = 1.0: two ordinary streams sharing every SM (MPS-style)
        ─► seconds per token, timed with CUDA events around each thread's loop

Each thread launches into its own stream; the CUDA calls release the GIL, so both queues
stay fed.  Memory levels change the kernels' batch (kernels.py), not a hard memory cap:
on one GPU the pair's combined footprint is what the level split allows.
"""

from __future__ import annotations

import threading

from jigsaw.mux.model.slowdown import DEFAULT_MEM_LEVELS, DEFAULT_SM_LEVELS, DeviceInfo
from jigsaw.mux.profiling.kernels import build_kernels, model_spec
from jigsaw.mux.profiling.profiler import ProfileConfig

H200_PEAK = (989e12, 4.8e12)
"""H200 datasheet: dense BF16 FLOP/s as H100, 4.8 TB/s HBM3e (no analytic prior ships for it)."""


def datasheet_peaks(name: str) -> tuple[float, float]:
    """(dense BF16 FLOP/s, HBM bytes/s) of a device by its family name; the driver reports
    neither.  The prior's DeviceInfo (jigsaw.mux.model.specs.DEVICES) where there is one; 1.0 when
    unknown, so an MFU computed from it reads as meaningless rather than plausible."""
    from jigsaw.mux.model.specs import DEVICES

    if "H200" in name:
        return H200_PEAK
    info = next((d for key, d in DEVICES.items() if key.upper() in name), None)
    return (info.peak_flops, info.mem_bw_bytes_per_s) if info else (1.0, 1.0)


class CudaBench:
    mem_levels = DEFAULT_MEM_LEVELS
    """Memory shares measured (a KV pool and micro-batches sized to each)."""

    def __init__(self, config: ProfileConfig):
        import torch

        from jigsaw.mux.partition.green import GreenPartitions
        from jigsaw.mux.partition.green_probe import probe

        self.config = config
        self.support = probe(config.gpu)  # GreenContextError says why when there is no usable GPU
        self.torch = torch
        self.dev = f"cuda:{config.gpu}"
        self.name, self.spec = model_spec(config.model or "qwen3-0.6b")
        self.parts = GreenPartitions(config.gpu, fracs=tuple(s for s in DEFAULT_SM_LEVELS if s < 1.0))
        self._kernels: dict[tuple[float, int], dict] = {}
        props = torch.cuda.get_device_properties(config.gpu)
        peak_flops, bw = datasheet_peaks(props.name)
        self.device_info = DeviceInfo(sku=props.name.replace("NVIDIA ", "").replace(" ", "-"),
                                      num_sms=props.multi_processor_count, mem_bytes=props.total_memory,
                                      peak_flops=peak_flops, mem_bw_bytes_per_s=bw)

    def close(self) -> None:
        self.parts.close()

    def _kernel(self, kind: str, mem_frac: float, side: int):
        key = (mem_frac, side)  # each side of a pair has its own weights: two pipelines, two models
        if key not in self._kernels:
            self._kernels[key] = build_kernels(self.spec, self.config.shapes, mem_frac,
                                               top_mem_frac=DEFAULT_MEM_LEVELS[-1], layers=self.config.layers,
                                               device=self.dev)
        return self._kernels[key][kind]

    def _streams(self, sm_frac: float):
        if sm_frac >= 1.0:
            return self.torch.cuda.Stream(self.dev), self.torch.cuda.Stream(self.dev)
        a, b = self.parts.pair(sm_frac)
        return a.stream, b.stream

    def alone(self, kind: str, sm_frac: float, mem_frac: float) -> float:
        stream = self._streams(sm_frac)[0]
        return self._timed([(self._kernel(kind, mem_frac, 0), stream)])[0]

    def pair(self, kind_a: str, kind_b: str, sm_frac_a: float, mem_frac_a: float) -> tuple[float, float]:
        sa, sb = self._streams(sm_frac_a)
        ka = self._kernel(kind_a, mem_frac_a, 0)
        kb = self._kernel(kind_b, round(1.0 - mem_frac_a, 9), 1)
        t = self._timed([(ka, sa), (kb, sb)])
        return t[0], t[1]

    def _timed(self, jobs) -> list[float]:
        """Run each (kernel, stream) in its own thread until a shared deadline; s per token."""
        torch = self.torch
        for k, s in jobs:  # warm-up (allocator, cuBLAS heuristics) outside the window
            s.wait_stream(torch.cuda.current_stream(self.dev))  # green streams are non-blocking
            with torch.cuda.stream(s):
                k.step()
        for _, s in jobs:  # each stream: a green context's work is not the primary context's to wait for
            s.synchronize()
        stop = threading.Event()
        out: list[float] = [0.0] * len(jobs)
        start = threading.Barrier(len(jobs))

        def loop(i: int, kernel, stream) -> None:
            with torch.cuda.stream(stream):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.wait()
                begin.record(stream)
                n = 0
                while not stop.is_set():
                    kernel.step()
                    n += 1
                    stream.synchronize()  # keep both queues short so the overlap is real
                end.record(stream)
                end.synchronize()
                out[i] = begin.elapsed_time(end) / 1e3 / (n * kernel.tokens)

        threads = [threading.Thread(target=loop, args=(i, k, s)) for i, (k, s) in enumerate(jobs)]
        for th in threads:
            th.start()
        threading.Event().wait(self.config.min_time_s)
        stop.set()
        for th in threads:
            th.join()
        return out
