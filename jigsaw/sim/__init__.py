"""Simulators: K RL pipelines sharing one node, with the node code the daemon runs.

    workload.py  TOML workload specs with provenance ─► samples of every step
    lengths.py   response-length shapes and empirical (JSONL) lengths
    lengthlog.py a user's logged lengths (JSONL, parquet, verl's dump) ─► an empirical workload
    deploy.py    per-pipeline TP / FSDP / offload; several engines on one scheduling device
    request.py   one sample: its sequence so far and what it still has to generate
    kvpool.py    the KV pool of an engine, bounded by its memory grant (admission,
                 eviction, retraction, recompute)
    rollout.py   continuous-batching engine per DP worker, one batch segment at a time
    pipeline.py  a pipeline's steps: rollout ─► reward ─► reference ─► training
    asynchronous.py  an asynchronous pipeline's rollout and training sides, joined by its
                 sample buffer (one-step off-policy, fully async)
    report.py    each engine's client: the protocol requests a live worker would send
    node.py      event heap; requests ─► jigsaw/node/ (NodeState, the daemon's) ─► Decision
                 ─► engines, budgets, physics, invariants, trace
    physics.py   ground-truth slowdowns: each side of a pair priced by its own model
    run.py       SimConfig ─► simulate() ─► SimResult; lower_bound()
    placement.py jigsaw's placement: each shape it runs on tried for a few steps, the fastest kept
    execute.py   the same node code on known graphs at sub-stage granularity (what-if, tests)
    replay.py    a recorded trace (simulator or daemon) re-packed, or its decisions replayed
    breakdown.py where a run's device time goes, read from its trace
    calibrate.py a grid scaled to the pipelines' own alone and shared runs
    advise.py    jobs from solo traces, paired under jigsaw / serial / static, best grouping
    cost.py      GPU-hours per step and $ per million tokens (every table's cost columns)
    workloads/   the shipped workloads

Step costs, grids and pair views come from jigsaw.mux.model (grids.py), never the other way.
No torch anywhere in this package: `jigsaw sim` runs on any CPU.
"""
