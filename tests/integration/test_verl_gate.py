"""The gated verl trainer and the post-import hook, without verl: a stand-in trainer class with
verl's method names, against a real daemon.

    gated(FakeTrainer) ─► each stage: an Admit per trainer rank (label=verl's name) ─► grants
                          ─► the stage runs ─► Done per rank
    after_import(module, fn) ─► fn(module) once the module is first imported (or at once)
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
from nodes import Node

from jigsaw.integrations.verl import trainer as vt
from jigsaw.integrations.verl.imports import after_import

pytestmark = pytest.mark.timeout(120)


class FakeTrainer:
    """verl's PPOTrainerSync as the gate sees it (names and call shapes of verl 0.9.1)."""

    def __init__(self, calls: list):
        self.calls, self.global_steps = calls, 1

    def _held(self) -> list[str]:
        """The kinds of the grants this trainer's client holds right now."""
        gate = self.__dict__.get("_jigsaw_gate")
        return [h.kind for h in gate.client._live.values()] if gate is not None else []

    def _stage(self, name, batch, metrics=None):
        self.calls.append((name, time.monotonic(), self._held()))
        return batch

    def _compute_reward_colocate(self, batch, metrics=None):
        return self._stage("reward", batch, metrics)

    def _compute_old_log_prob(self, batch, metrics):
        return self._stage("old_log_prob", batch, metrics)

    def _compute_ref_log_prob(self, batch, metrics):
        return self._stage("ref", batch, metrics)

    def _update_actor(self, batch, metrics):
        return self._stage("update_actor", batch, metrics)

    def on_step_end(self):
        self.calls.append(("update_weights", time.monotonic(), self._held()))

    def on_sample_begin(self):
        self.calls.append(("sample_begin", time.monotonic(), self._held()))


class Batch:
    keys = ["a", "b", "c"]


def _under_a_daemon(tmp_path, monkeypatch) -> Node:
    """A two-device daemon, and this process as the trainer of `jigsaw run --name verl-job`
    whose two ranks are this process (the caller stops the node)."""
    node = Node(tmp_path)
    node.start("--devices", "2")
    monkeypatch.setattr(vt.Gate, "pids", lambda self, trainer: (os.getpid(), os.getpid()))
    for k, v in {**node.env, "JIGSAW_ENDPOINT": node.ep, "JIGSAW_PIPELINE": "verl-job"}.items():
        monkeypatch.setenv(k, v)
    return node


def test_each_verl_stage_is_admitted_as_a_gang_before_it_runs_and_reported_after(tmp_path, monkeypatch):
    """Two trainer ranks on a two-device node: every stage is a sub-stage per rank, both
    granted before verl's call runs, both done after it, each with its half of the batch."""
    node = _under_a_daemon(tmp_path, monkeypatch)
    try:
        calls = []
        t = vt.gated(FakeTrainer)(calls)
        batch = Batch()
        t.on_sample_begin()  # the trainer's wait for the rollout is not a stage: the replicas' regimes are
        assert t._compute_reward_colocate(batch) is batch  # verl's validation calls it without metrics
        for name in ("_compute_old_log_prob", "_compute_ref_log_prob", "_update_actor"):
            assert getattr(t, name)(batch, metrics={}) is batch
        t.on_step_end()
        t._jigsaw_gate.client.close()
    finally:
        node.stop()
    ev = node.events()
    t0 = next(e["data"]["clock_t0_s"] for e in ev if e["event"] == "node")
    grants = {e["substage"]: e for e in ev if e["event"] == "grant"}
    done = {e["substage"]: e for e in ev if e["event"] == "done"}
    asked = [(e["data"]["label"], e["data"]["kind"], e["data"]["rank"], e["substage"]) for e in ev
             if e["event"] == "request"]
    stages = [("reward", "reference"), ("old_log_prob", "reference"), ("ref", "reference"),
              ("update_actor", "training"), ("update_weights", "training")]
    assert [(label, kind, rank) for label, kind, rank, _ in asked] == [
        (label, kind, rank) for label, kind in stages for rank in (0, 1)]
    ran = {name: t for name, t, _ in calls}
    held = {name: kinds for name, _, kinds in calls}
    assert held == {"sample_begin": [], "reward": ["reference"] * 2, "old_log_prob": ["reference"] * 2,
                    "ref": ["reference"] * 2, "update_actor": ["training"] * 2,
                    "update_weights": ["training"] * 2}  # each ran inside both ranks' grants
    for label, _, rank, sid in asked:  # t_s is the daemon's time.monotonic() less t0: our clock, shifted
        assert sid in grants and sid in done, sid
        assert grants[sid]["device"] == rank
        assert grants[sid]["t_s"] + t0 <= ran[label] <= done[sid]["t_s"] + t0, label  # granted, ran, reported
    assert [done[sid]["data"]["batch_size"] for label, _, _, sid in asked if label == "old_log_prob"] == [1.5, 1.5]


def test_a_trainer_already_gated_is_not_gated_twice():
    g = vt.gated(FakeTrainer)
    assert g.jigsaw_gated and g.__name__ == "FakeTrainer" and issubclass(g, FakeTrainer)


def test_after_import_runs_once_the_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "late_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("late_mod", lambda m: seen.append(m.VALUE + 1))
    assert seen == []  # not imported yet
    import late_mod  # noqa: F401

    assert seen == [42]
    after_import("late_mod", lambda m: seen.append("now"))  # already imported: at once
    assert seen == [42, "now"]
    sys.modules.pop("late_mod", None)


def test_a_failing_patch_leaves_the_import_working(tmp_path, monkeypatch):
    (tmp_path / "late_mod2.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    after_import("late_mod2", lambda m: 1 / 0)
    import late_mod2

    assert late_mod2.VALUE == 1
    sys.modules.pop("late_mod2", None)


def test_outside_jigsaw_run_nothing_is_installed(monkeypatch):
    monkeypatch.delenv("JIGSAW_PIPELINE", raising=False)
    before = list(sys.meta_path)
    vt.install()
    assert sys.meta_path == before


def test_the_opt_in_poll_shortens_verls_replay_buffer_poll_and_nothing_else(monkeypatch):
    import types

    from jigsaw.integrations.verl import poll

    class ReplayBuffer:  # verl 0.9.1's constructor default (the contract test checks the name)
        def __init__(self, trainer_mode, poll_interval: float = 2.0):
            self.trainer_mode, self.poll_interval = trainer_mode, poll_interval

    module = types.SimpleNamespace(ReplayBuffer=ReplayBuffer)
    poll._patch(module, 0.05)
    poll._patch(module, 0.5)  # once only
    assert ReplayBuffer("sync").poll_interval == 0.05
    assert ReplayBuffer("sync", poll_interval=0.01).poll_interval == 0.01  # never longer than asked
    monkeypatch.setenv(poll.ENV, "-1")
    with pytest.raises(ValueError, match="JIGSAW_VERL_POLL_S"):
        poll.install()
    monkeypatch.delenv(poll.ENV)
    before = list(sys.meta_path)
    poll.install()  # unset: verl as it is
    assert sys.meta_path == before


class FakeAsyncTrainer(FakeTrainer):
    """verl's PPOTrainerColocateAsync as the gate sees it: its mode, its bound, batches of 4 prompts."""

    trainer_mode = "colocate_async"

    def __init__(self, calls: list):
        super().__init__(calls)
        self.config = SimpleNamespace(data=SimpleNamespace(train_batch_size=4),
                                      trainer=SimpleNamespace(v1=SimpleNamespace(
                                          sampler={"max_off_policy_threshold": 2})))


def test_an_async_trainer_is_its_jobs_training_side_and_its_rollouts_count_batches(tmp_path, monkeypatch):
    """verl's asynchronous trainers: the gangs under `<job>.train`, registered with the job, its
    mode and bound; each prompt's rollout step is the batch it completes, not the trainer's step."""
    node = _under_a_daemon(tmp_path, monkeypatch)
    try:
        t = vt.gated(FakeAsyncTrainer)([])
        assert t._compute_old_log_prob(Batch(), metrics={}) is not None
        t._jigsaw_gate.client.close()
    finally:
        node.stop()
    ev = node.events()
    assert {e["pipeline"] for e in ev if e["event"] == "request"} == {"verl-job.train"}
    assert [e["data"] for e in ev if e["event"] == "job"] == [{"job": "verl-job", "mode": "fully-async",
                                                                "staleness": 2}]
    steps = [vt._rollout_step(t, n) for n in (4, 4, 2, 2, 3)]  # the warm-up batch, then steps topped up
    assert steps == [1, 2, 3, 3, 4]
    sync = vt.gated(FakeTrainer)([])
    sync.global_steps = 7
    assert vt._rollout_step(sync, 4) == 7  # sync: the step the trainer waits in


class FakeOneStepOff(FakeTrainer):
    """verl's OneStepOffRayTrainer as the gate sees it: RayPPOTrainer's stage methods (no
    metrics argument), its weight sync `_fit_update_weights`, the replicas of its checkpoint manager."""

    def __init__(self, calls: list):
        super().__init__(calls)
        self.global_steps = 0  # verl syncs once before step 1
        self.config = SimpleNamespace()

    def _compute_old_log_prob(self, batch):
        return self._stage("old_log_prob", batch)

    def _fit_update_weights(self):
        self.calls.append(("update_weights", time.monotonic(), self._held()))


class FakeFullyAsync(FakeOneStepOff):
    """verl's FullyAsyncTrainer: an async weight sync that moves weights only on the step that
    completes `trigger_parameter_sync_step`, and verl's bound as a fraction."""

    def __init__(self, calls: list):
        super().__init__(calls)
        self.local_trigger_step = 1
        self.config = SimpleNamespace(async_training=SimpleNamespace(staleness_threshold=0.5,
                                                                     trigger_parameter_sync_step=2))

    async def _fit_update_weights(self):
        self.calls.append(("update_weights", time.monotonic(), self._held()))


@pytest.mark.parametrize("base, mode, bound", [(FakeOneStepOff, "one-step-off", 1), (FakeFullyAsync, "fully-async", 3)])
def test_verls_experimental_trainers_gate_their_stages_and_sync_as_their_jobs_training_side(
        tmp_path, monkeypatch, base, mode, bound):
    """one_step_off_policy / fully_async_policy: each stage and each weight sync that moves
    weights is a gang of `<job>.train`, registered with the job's mode and bound; after the sync
    of step N the replicas' rollouts are step N + 1; a sync verl skips is not asked for."""
    import asyncio

    told = []
    monkeypatch.setattr(vt, "_tell_replicas", lambda trainer, step: told.append(step))
    node = _under_a_daemon(tmp_path, monkeypatch)
    try:
        calls = []
        t = vt.gated(base, mode)(calls)

        def sync():
            out = t._fit_update_weights()
            return asyncio.run(out) if asyncio.iscoroutine(out) else out

        sync()  # before step 1
        t.global_steps = 1
        assert t._compute_old_log_prob(Batch()) is not None
        sync()
        if mode == "fully-async":
            t.global_steps, t.local_trigger_step = 2, 2
            sync()  # verl returns at once: no weights move
        t._jigsaw_gate.client.close()
    finally:
        node.stop()
    ev = node.events()
    asked = [(e["pipeline"], e["data"]["label"], e["data"]["step"]) for e in ev if e["event"] == "request"]
    assert asked == [(p, label, step) for p, label, step in [
        ("verl-job.train", "update_weights", 0), ("verl-job.train", "update_weights", 0),
        ("verl-job.train", "old_log_prob", 1), ("verl-job.train", "old_log_prob", 1),
        ("verl-job.train", "update_weights", 1), ("verl-job.train", "update_weights", 1)]]
    assert [e["data"] for e in ev if e["event"] == "job"] == [{"job": "verl-job", "mode": mode, "staleness": bound}]
    assert [held for name, _, held in calls] == [["training"] * 2, ["reference"] * 2, ["training"] * 2] + (
        [[]] if mode == "fully-async" else [])  # the skipped sync ran, outside any grant
    assert told == [1, 2]
