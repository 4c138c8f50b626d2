"""The demo's pipelines begin their first measured step together (jigsaw.recipes.start_gate)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jigsaw.recipes.start_gate import ENV, gate_env, wait_at_gate

WAITER = "from jigsaw.recipes.start_gate import wait_at_gate; print(wait_at_gate(print, deadline_s=60, step=1))"


@pytest.mark.timeout(60)
def test_a_pipeline_waits_at_the_gate_until_every_partner_arrived(tmp_path):
    env = {**__import__("os").environ, **gate_env(tmp_path / "gate", 2, step=1)}
    first = subprocess.Popen([sys.executable, "-c", WAITER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # alone at the gate: still waiting
            first.wait(timeout=3)
        assert len(list((tmp_path / "gate").iterdir())) == 1, "the waiter did not say it arrived"
        second = subprocess.run([sys.executable, "-c", WAITER], env=env, capture_output=True, text=True, timeout=30)
        assert second.returncode == 0 and float(second.stdout) < 30
        out, _ = first.communicate(timeout=30)
        # it waited for its partner, and then went on: from its own arrival to the partner's
        # (each touched its file as it arrived; the start-ups before that vary with the load)
        arrived = sorted(p.stat().st_mtime for p in (tmp_path / "gate").iterdir())
        assert float(out) >= arrived[1] - arrived[0] - 0.05
    finally:
        first.kill()


def test_a_partner_that_never_comes_holds_nobody_past_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, f"{tmp_path}:3:0")
    said = []
    assert wait_at_gate(said.append, deadline_s=0.2) >= 0.2
    assert said == ["start gate: 1 of 3 pipelines arrived in 0.2 s; starting anyway"]


def test_no_gate_outside_the_demo_and_a_malformed_one_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert wait_at_gate() is None
    monkeypatch.setenv(ENV, f"{tmp_path}:2")
    with pytest.raises(ValueError, match="expected DIR:N:STEP"):
        wait_at_gate()


def test_the_gate_stands_before_its_step_only(tmp_path, monkeypatch):
    """A pipeline passes the other steps at once: only the first measured step is gated."""
    monkeypatch.setenv(ENV, f"{tmp_path}:2:1")
    assert wait_at_gate(deadline_s=30, step=0) is None and not list(tmp_path.iterdir())
    assert wait_at_gate(deadline_s=0.1, step=1) >= 0.1 and len(list(tmp_path.iterdir())) == 1
