"""jigsaw: multiplex LLM RL post-training pipelines on shared GPUs (JigsawRL).

    StepRecord ─► GraphBuilder ─► SubStageGraph ───────────┐
    SlowdownGrid (profiles/, `jigsaw prior`) ───────────────┼─► schedule() ─► Plan
    NodeSpec, PipelineState × K, SchedulerConfig ──────────┘        │
                                              execute() (what-if) ◄─┘─► runtime / simulator

The scheduler library, the simulator and the daemon import no torch: extras.py names the extra
(`pip install 'jigsaw[cpu]'`, `[gpu]`, `[timeline]`, `[verl]`) each optional import comes from.

Names are imported on first use, so `import jigsaw` costs nothing until you need a part.
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
    "jigsaw.graph.execute": ("Execution", "Interval", "execute"),
    "jigsaw.graph.merge": ("Balance", "MergeConfig", "MergeDecision", "TailWorker", "balance", "best_merge",
                           "merge_decision"),
    "jigsaw.mux.slowdown": ("DeviceInfo", "SlowdownFileError", "SlowdownGrid", "load_grid"),
    "jigsaw.mux.prior": ("PriorConfig", "analytic_prior"),
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
