"""Simulators: K RL pipelines sharing one node, with the node code the daemon runs.

    workload.py  TOML workload specs with provenance ─► samples of every step
    lengths.py   response-length shapes and empirical (JSONL) lengths
    deploy.py    per-pipeline TP / FSDP / offload; several engines on one scheduling device
    request.py   a simulated request (its turns, tool waits, what it generated)
    kvpool.py    an engine's KV pool bounded by its memory grant (admission, retraction)
    rollout.py   continuous-batching engine per DP worker, one batch segment at a time
    pipeline.py  a pipeline's steps: rollout ─► reward ─► reference ─► training
    report.py    each engine's client: the protocol requests a live worker would send
    node.py      event heap; requests ─► jigsaw/node/ (NodeState, the daemon's) ─► Decision
                 ─► engines, budgets, physics, invariants, trace
    physics.py   ground-truth slowdowns: each side of a pair priced by its own model
    run.py       SimConfig ─► simulate() ─► SimResult; lower_bound()
    execute.py   the same node code on known graphs at sub-stage granularity (what-if, tests)
    replay.py    a trace re-packed under any policy, or a daemon's decisions replayed
    breakdown.py where the device time of a run went
    calibrate.py a grid's factors fitted to what live runs measured
    workloads/   the shipped workloads

No torch anywhere in this package: `jigsaw sim` runs on any CPU.
"""
