"""Discrete-event simulator of one node shared by K RL pipelines (JigsawRL §5 setting).

    workload.py  TOML workload specs with provenance ─► samples of every step
    lengths.py   response-length shapes and empirical (JSONL) lengths
    deploy.py    per-pipeline TP / FSDP / offload; several engines on one scheduling device
    rollout.py   continuous-batching engine per DP worker, one batch segment at a time, with
                 a KV pool bounded by its memory grant (admission, retraction, recompute)
    pipeline.py  a pipeline's steps: rollout ─► reward ─► reference ─► training
    view.py      live state ─► PipelineState for policies (what the runtime builds too)
    (policies: jigsaw/graph/policy.py and baselines.py, the ones the daemon runs live)
    node.py      event heap, policy calls, plan application, invariants, trace
    physics.py   ground-truth slowdowns: each side of a pair priced by its own model
    run.py       SimConfig ─► simulate() ─► SimResult; lower_bound()

No torch anywhere in this package: `jigsaw sim` runs on any CPU.
"""
