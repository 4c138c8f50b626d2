"""The device side of multiplexing: how much two co-located sub-stages slow each other, how
that is measured, how a budget becomes a partition on a device, and what the device reports.

    model/       the cost model, pure (no torch): what the scheduler and the simulator read
        specs ─► roofline ─► prior ─► pairing ─► grids ─► SlowdownGrid / PairGrids / StepCost
        slowdown (the grid file format, interpolation) ◄─ validate; costmodel (step times)
    profiling/   measuring a grid on this machine (`jigsaw profile`)
        cpu_bench | cuda_bench (+ kernels) ─► profiler.measure_grid ─► SlowdownGrid (model/)
    partition/   a budget σ on a device: descriptors in the daemon, binding in the worker
        partitioners (pure) ─► Grant.partition ─► bind ─► core sets (cpu) | green contexts
        (green_probe, green, green_backends; smsplit rounds) ─► cudagraphs per budget;
        mps (processes of two jobs at once), smid (did the work stay on its SMs?)
    telemetry    NVML samples of every GPU into the trace (`jigsaw daemon --telemetry-s`)

Imports run one way between the rooms: profiling ─► partition ─► model, and nothing here
imports the engines, the runtime or the simulator (they import mux; tests/unit/test_imports.py
checks).  Nothing imports torch, cuda-python or pynvml at module level.
"""
