"""The GRPO recipe's checkpoints (recipes/checkpoint.py): a run stopped after its second step
goes on, re-placed with another trainer world size, from where it was.

What a resumed step trained from shows in its own checkpoint: AdamW counts its steps, so the
resumed run's save after step 2 counts 3 only if it went on from the first run's optimizer (a
run that did not load would count 1; the tiny random model earns no reward here, so its weights
alone would not tell: a zero advantage moves nothing).  A run sent SIGTERM between two steps
stops there, its result and checkpoint saying how far it got."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from nodes import ROOT
from waiting import HANG_S, wait_until

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

SMALL = ("--prompts", "2", "--group", "2", "--max-new-tokens", "16", "--threads", "1")


def _recipe(tmp_path, tag: str, *extra: str) -> tuple[int, dict | None, str]:
    result = tmp_path / f"{tag}.json"
    done = subprocess.run([sys.executable, "-m", "jigsaw.recipes.grpo", *SMALL, "--result", str(result), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    return done.returncode, json.loads(result.read_text()) if done.returncode == 0 else None, done.stderr


def _adam_steps(step_dir, tmp_path) -> set[float]:
    """AdamW's step count of every parameter in a checkpoint (read without a process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    return {float(v["step"]) for v in torch.load(out, weights_only=False)["optim"]["state"].values()}


def test_a_run_goes_on_from_its_last_step_with_another_world_size_and_another_pipelines_is_refused(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    rc, first, err = _recipe(tmp_path, "first", "--steps", "2", "--train-ranks", "2", "--checkpoint-dir", ckpt)
    assert rc == 0, err[-3000:]
    assert first["resumed_steps"] == 0
    rc, then, err = _recipe(tmp_path, "then", "--steps", "3", "--train-ranks", "1", "--checkpoint-dir", ckpt)
    assert rc == 0, err[-3000:]
    assert "resumed after step 1" in err
    assert then["resumed_steps"] == 2 and [s["step"] for s in then["steps"]] == [0, 1, 2]
    assert then["steps"][:2] == first["steps"]  # each step once: the saved results, not run again
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-1", "step-2"]  # the newest two kept
    assert [_adam_steps(tmp_path / "ckpt" / d, tmp_path) for d in ("step-1", "step-2")] == [{2.0}, {3.0}]

    rc, _, err = _recipe(tmp_path, "other", "--steps", "3", "--seed", "7", "--checkpoint-dir", ckpt)
    assert rc == 2 and "checkpoint of another pipeline" in err and "'seed': (0, 7)" in err


def test_sigterm_between_two_steps_stops_the_run_there_with_its_result_and_checkpoint(tmp_path):
    from jigsaw.recipes.grpo import STOPPED_RC
    from jigsaw.recipes.start_gate import ENV as GATE

    gate, ckpt, result = tmp_path / "gate", tmp_path / "ckpt", tmp_path / "r.json"
    gate.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "jigsaw.recipes.grpo", *SMALL, "--steps", "3", "--result",
                             str(result), "--checkpoint-dir", str(ckpt)], cwd=ROOT,
                            env={**os.environ, GATE: f"{gate}:2:1"}, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: any(gate.iterdir()) or proc.poll() is not None, 240, "the run held before step 1")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # waiting at the gate, for a partner that never comes
        err = proc.communicate(timeout=HANG_S)[1]
    finally:
        proc.kill()
    assert proc.returncode == STOPPED_RC and time.monotonic() - t0 < HANG_S, err[-3000:]
    assert "stopped (SIGTERM) after 1 step(s), all saved" in err
    doc = json.loads(result.read_text())
    assert doc["stopped"] and [s["step"] for s in doc["steps"]] == [0]
    assert [p.name for p in ckpt.iterdir()] == ["step-0"]
