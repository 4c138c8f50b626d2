"""One node's ledger: the facts of its pipelines, the decisions about them, and what they do.

    worker requests (jigsaw/protocol.py: Admit, Done, Progress, …) from the daemon's
    clients, the simulator's engines or a replayed trace
        ─► inputs.py  Inbox: the one mapping of a request onto the node's facts
        ─► state.py   NodeState: the only writer of the facts; decide() ─► view ─► policy ─► apply
                ledger.py  LivePipeline: one pipeline's facts, changed by named methods only
                view.py    the facts ─► the scheduler's PipelineState (one builder)
                jobs.py    an asynchronous job's sides: linked through its sample buffer in
                           the view, an idle side counted on, both planned in one group
                learning.py GrantLog: where grants ran on the grid, evidence for a learned grid
                slo.py     StepClock: each step's latency against its exclusive time and SLO
                           (deadlines for the view; outcomes for traces, status, metrics)
        ─► effects.py Decision: frozen, everything acting on it needs (admitted, changed,
                      moved, every holder, orders); the one capacity check
        ─► the daemon's grants (runtime/grants.py), the simulator's engines (sim/node.py),
           the graph executor's timeline (sim/execute.py)

No I/O and no device here: the same code decides live and simulated.
"""
