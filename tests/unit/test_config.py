"""House rules for config dataclasses: frozen, keyword-only, a default and a docstring per field."""

import ast
import dataclasses
import inspect

import pytest

from jigsaw.cluster.launch import LaunchConfig
from jigsaw.cluster.simulate import ClusterConfig
from jigsaw.engines.model import ModelConfig
from jigsaw.engines.rollout import RolloutConfig
from jigsaw.engines.sandbox import SandboxConfig
from jigsaw.engines.training import TrainConfig
from jigsaw.graph.builder import GraphConfig
from jigsaw.graph.merge import MergeConfig
from jigsaw.graph.plan import SchedulerConfig
from jigsaw.integrations.sglang.plugin import PluginConfig
from jigsaw.integrations.verl.job import JobConfig
from jigsaw.integrations.verl.server import ServerConfig
from jigsaw.mux.model.learned import LearnConfig
from jigsaw.mux.model.specs import PriorConfig
from jigsaw.mux.profiling.profiler import ProfileConfig
from jigsaw.recipes.demo import DemoConfig
from jigsaw.recipes.gpu_grpo import GpuRecipeConfig
from jigsaw.recipes.grpo import RecipeConfig
from jigsaw.runtime.daemon import DaemonConfig
from jigsaw.sim.run import SimConfig

CONFIGS = [GraphConfig, SchedulerConfig, MergeConfig, PriorConfig, SimConfig, DaemonConfig, ProfileConfig,
           RecipeConfig, GpuRecipeConfig, DemoConfig, ModelConfig, RolloutConfig, TrainConfig, JobConfig, ServerConfig,
           PluginConfig, SandboxConfig, LearnConfig, ClusterConfig, LaunchConfig]


def _field_docstrings(cls) -> set[str]:
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    documented = set()
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            documented.add(node.target.id)
    return documented


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_config_fields_have_defaults_and_docstrings(cls):
    fields = dataclasses.fields(cls)
    assert cls.__dataclass_params__.frozen, f"{cls.__name__} must be frozen"
    assert all(f.kw_only for f in fields), f"{cls.__name__} must be keyword-only"
    missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert not missing, f"{cls.__name__} fields without default: {missing}"
    undocumented = {f.name for f in fields} - _field_docstrings(cls)
    assert not undocumented, f"{cls.__name__} fields without docstring: {undocumented}"
    cls()  # defaults are valid


def test_public_api_resolves_lazily():
    import jigsaw

    for name in jigsaw.__all__:
        assert getattr(jigsaw, name) is not None
    with pytest.raises(AttributeError):
        jigsaw.not_a_thing  # noqa: B018


def test_every_config_class_is_checked():
    """A new `*Config` dataclass anywhere in the package joins the list above."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "jigsaw"
    declared = {m for f in root.rglob("*.py") for m in re.findall(r"^class (\w+Config)\b", f.read_text(), re.M)}
    assert declared == {c.__name__ for c in CONFIGS}


def test_scheduler_config_is_owned_once():
    """The simulator and the daemon nest the scheduler's config instead of copying its fields."""
    sched = {f.name for f in dataclasses.fields(SchedulerConfig)}
    for outer in (SimConfig, DaemonConfig):
        fields = {f.name: f for f in dataclasses.fields(outer)}
        assert fields["sched"].type in (SchedulerConfig, "SchedulerConfig")
        assert not (sched & set(fields) - {"sched"}), f"{outer.__name__} copies {sched & set(fields)}"


@pytest.mark.parametrize("heartbeat_s", [0.25, 30.0, 60.0])
def test_a_daemons_heartbeat_is_a_wait_the_wire_accepts(heartbeat_s):
    """Clients send the heartbeat_s a daemon told them as their Heartbeat.wait_s: a daemon that
    accepted one above the wire's bound would refuse every beat of every client."""
    from jigsaw import protocol as pr

    config = DaemonConfig(heartbeat_s=heartbeat_s, lease_s=2 * heartbeat_s)
    beat = pr.Heartbeat(session="s", wait_s=config.heartbeat_s, req=1)
    assert pr.decode_request(pr.encode(beat)) == beat
    with pytest.raises(ValueError, match="heartbeat_s"):
        DaemonConfig(heartbeat_s=heartbeat_s + 60.0, lease_s=4 * (heartbeat_s + 60.0))
    with pytest.raises(ValueError, match="heartbeat_s"):
        DaemonConfig(heartbeat_s=heartbeat_s, lease_s=heartbeat_s)  # a lease that lapses between beats
