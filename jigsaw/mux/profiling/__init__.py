"""Measuring a slowdown grid on this machine (`jigsaw profile`).

    profiler.py    ProfileConfig, the Bench protocol, measure_grid(bench) ─► SlowdownGrid
                   (model/slowdown.py format, source "measured", noise recorded)
    cpu_bench.py   CpuBench: two spawned workers on core sets (partition/cpu.py, bind.py),
                   the model its caller hands in (`jigsaw profile` loads the recipe's)
    cuda_bench.py  CudaBench: kernels on green-context pairs (partition/green.py)
    kernels.py     the sub-stage kernels of a decoder built from a model config (torch)

torch is imported inside the benches only; the grid they produce is checked by
model/validate.py before `jigsaw profile` writes it.
"""
