"""jigsaw: multiplex LLM RL post-training pipelines on shared GPUs (JigsawRL).

    StepRecord ─► GraphBuilder ─► SubStageGraph ───────────┐
    SlowdownGrid (profiles/, `jigsaw prior`) ───────────────┼─► schedule() ─► Plan
    NodeSpec, PipelineState × K, SchedulerConfig ──────────┘        │
                                              execute() (what-if) ◄─┘─► runtime / simulator

The scheduler library, the simulator and the daemon import no torch: extras.py names the extra
(`pip install 'jigsaw[cpu]'`, `[gpu]`, `[timeline]`, `[verl]`) each optional import comes from.

Names are imported on first use, so `import jigsaw` costs nothing until you need a part.

    graph/         the sub-stage graph, its scheduling and every policy (pure)
    node/          one node's ledger: facts from worker requests, decisions, their effects
    mux/           the device side: slowdown models, profiling, partitions and binding, telemetry
    runtime/       the node daemon and the pipeline-side client (a Unix socket)
    sim/           simulators fed the daemon's requests: a node, and graphs at sub-stage level
    cluster/       pipelines placed on the nodes of a cluster of GPU kinds (`jigsaw sim --nodes`)
    engines/       CPU engines of real pipelines (torch, transformers)
    recipes/       pipelines built from them, and `jigsaw demo`
    integrations/  verl and SGLang, unmodified
    timeline/      what every device did, from a trace
    cli/           one module per `jigsaw` subcommand
    protocol.py    the requests workers send their node (the wire, and the simulator's diet)
    env.py         the environment a pipeline's processes find their node by
    trace.py       one JSON-lines trace format for the daemon and the simulator
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "jigsaw.graph.substage": ("Stage", "StepRecord", "SubStage", "SubStageKind"),
    "jigsaw.graph.graph": ("CriticalPath", "SubStageGraph"),
    "jigsaw.graph.builder": ("BucketTracker", "GraphBuilder", "GraphConfig", "Transition", "build_step_graph",
                             "predict_next"),
    "jigsaw.graph.plan": ("Assignment", "Budget", "Migration", "NodeSpec", "PipelineState", "Plan", "Routing",
                          "SchedulerConfig"),
    "jigsaw.graph.schedule": ("schedule",),
    "jigsaw.sim.execute": ("Execution", "Interval", "execute"),
    "jigsaw.graph.merge": ("Balance", "MergeConfig", "MergeDecision", "TailWorker", "balance", "best_merge",
                           "merge_decision"),
    "jigsaw.mux.model.slowdown": ("DeviceInfo", "SlowdownFileError", "SlowdownGrid", "load_grid"),
    "jigsaw.mux.model.specs": ("PriorConfig",),
    "jigsaw.mux.model.prior": ("analytic_prior",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'jigsaw' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
