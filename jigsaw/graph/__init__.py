"""The sub-stage graph abstraction and its scheduling (JigsawRL §4.1, §4.3, §4.4).

    StepRecord ─► builder ─► SubStageGraph ─► schedule() ─► Plan ─► execute() / runtime / sim
                                                 │  ▲
                       state (mechanics) ◄── actions (options, cost) ── merge (ΔT, balancing)

substage.py  records and sub-stages        builder.py   buckets, hysteresis, prediction
graph.py     DAG, frontier, critical path  plan.py      scheduler inputs and the frozen Plan
state.py     copyable node state           actions.py   action space and critical-path cost
schedule.py  windowed look-ahead search    merge.py     migration ΔT and balancing
execute.py   applies Plans over time (what-if runs, tests, benchmarks)
"""
