"""Discrete-event simulator of one node shared by K RL pipelines (JigsawRL §5 setting).

    workload.py  TOML workload specs with provenance ─► samples of every step
    rollout.py   continuous-batching engine per DP worker, one batch segment at a time
    pipeline.py  a pipeline's steps: rollout ─► reward ─► reference ─► training
    view.py      live state ─► PipelineState for policies (what the runtime builds too)
    (policies: jigsaw/graph/policy.py and baselines.py, the ones the daemon runs live)
    node.py      event heap, policy calls, plan application, invariants, trace
    run.py       SimConfig ─► simulate() ─► SimResult; lower_bound()

No torch anywhere in this package: `jigsaw sim` runs on any CPU.
"""
