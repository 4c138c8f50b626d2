"""The sub-stage graph abstraction and its scheduling (JigsawRL §4.1, §4.3, §4.4): pure code.

    StepRecord ─► builder ─► SubStageGraph ─► PipelineState × K ─► policy.plan(View) ─► Plan
                                                  schedule() (look-ahead) or a baseline
                                   state (mechanics) ◄── actions (options, cost) ── merge (ΔT)

The abstraction
    substage.py   records and sub-stages: the vocabulary every other module speaks
    ids.py        sub-stage ids, the one place that writes and reads them
    graph.py      per-pipeline DAG: dependencies, frontier, critical path
    builder.py    forward-step records ─► one step's graph (buckets, hysteresis); prediction
    steps.py      forward steps in bulk: columns, vectorised hysteresis, per-piece summaries
    residual.py   how long a live tail still runs (residual life of response lengths)
Scheduling
    plan.py       the scheduler's inputs (PipelineState, NodeSpec, SchedulerConfig) and Plan
    model.py      what the scheduler asks of a slowdown model (the typed seam with mux/)
    problem.py    the static side of an instance: tasks of every pipeline in one index space
    state.py      compact, copyable node state the search simulates forward
    context.py    per-call constants: options and the slowdown lookups the search uses
    actions.py    the action space and its critical-path cost
    deadlines.py  SLO deadlines in that cost: lateness first, the memory splits that keep them
    schedule.py   the windowed look-ahead: a pure function to a Plan
    merge.py      long-tail migration (ΔT) and multiplexing-aware balancing
    slo.py        slowdown SLOs: a step's exclusive time, its deadline, the plan's forecast
Policies
    placement.py  where k pipelines go on n devices: the shapes the policies place by
    policy.py     the one Policy protocol, its View, and the look-ahead as a policy (Jigsaw)
    baselines.py  serial, split, static, muxserve, rollmux, hrrs
    async_baselines.py  streamrl, areal: the asynchronous systems' placement
    buffer.py     an asynchronous pipeline's sample buffer: staleness bound, weight versions
    policies.py   every policy by name (`make`)

Nothing here holds a live node's facts or acts on a plan: that is jigsaw/node/ (one ledger,
one view, one applier), used by the daemon (runtime/) and the simulators (sim/).
"""
