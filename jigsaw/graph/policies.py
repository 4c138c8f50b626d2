"""Every policy by name: what `jigsaw daemon --policy` and `jigsaw sim --policy` build.

    make(name, config) ─► Jigsaw (policy.py: the look-ahead; greedy is it at W = 1)
                       └► Serial | Split | Static | MuxServe | RollMux | HRRS  (baselines.py)
                       └► StreamRL | AReaL  (async_baselines.py: asynchronous pipelines)

A fresh policy per call: the daemon holds one, every simulation its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from jigsaw.graph import async_baselines, baselines
from jigsaw.graph.plan import SchedulerConfig
from jigsaw.graph.policy import Jigsaw, Policy

NAMES = ("serial", "split", "static", "muxserve", "rollmux", "hrrs", "streamrl", "areal", "greedy", "jigsaw")
"""Every policy `make` knows, baselines first."""
ASYNC_ONLY = ("streamrl", "areal")
"""Baselines that differ from split only for asynchronous pipelines."""


def make(name: str, config: SchedulerConfig = SchedulerConfig()) -> Policy:
    """A fresh policy; `config` is the scheduler's (jigsaw, and greedy at W = 1)."""
    factories: dict[str, Callable[[], Policy]] = {
        "serial": baselines.Serial, "split": baselines.Split, "static": baselines.Static,
        "muxserve": baselines.MuxServe, "rollmux": baselines.RollMux, "hrrs": baselines.HRRS,
        "streamrl": async_baselines.StreamRL, "areal": async_baselines.AReaL,
        "greedy": lambda: Jigsaw(name="greedy", config=replace(config, window=1)),
        "jigsaw": lambda: Jigsaw(config=config)}
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(NAMES)}")
    return factories[name]()
