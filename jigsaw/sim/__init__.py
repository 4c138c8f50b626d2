"""Discrete-event simulator of one node shared by K RL pipelines (JigsawRL §5 setting).

    workload.py  TOML workload specs with provenance ─► samples of every step
    lengths.py   response-length shapes and empirical (JSONL) lengths
    deploy.py    per-pipeline TP / FSDP / offload; several engines on one scheduling device
    request.py   one sample: its sequence so far and what it still has to generate
    kvpool.py    the KV pool of an engine, bounded by its memory grant (admission,
                 eviction, retraction, recompute)
    rollout.py   continuous-batching engine per DP worker, one batch segment at a time
    pipeline.py  a pipeline's steps: rollout ─► reward ─► reference ─► training
    report.py    what the engines tell the node state, as their clients would
    (policies: jigsaw/graph/policy.py and baselines.py, the ones the daemon runs live)
    node.py      event heap, policy calls, plan application, invariants, trace
    physics.py   ground-truth slowdowns: each side of a pair priced by its own model
    run.py       SimConfig ─► simulate() ─► SimResult; lower_bound()
    breakdown.py where a run's device time goes, read from its trace
    replay.py    a recorded trace (simulator or daemon) re-packed, or its decisions replayed
    calibrate.py a grid scaled to the pipelines' own alone and shared runs

Step costs, grids and pair views come from jigsaw.mux.model (grids.py), never the other way.
No torch anywhere in this package: `jigsaw sim` runs on any CPU.
"""
