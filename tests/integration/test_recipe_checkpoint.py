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


def _ledger_whole(doc: dict, steps: int, per_batch: int) -> None:
    """Every sample of every step trained once, within the bound, each step once, in order."""
    assert sorted(u for u, _, _ in doc["ledger"]) == list(range(steps * per_batch)), "a sample lost or trained twice"
    assert all(0 <= step - born <= doc["staleness"] for _, born, step in doc["ledger"])
    assert [s["step"] for s in doc["steps"]] == list(range(steps))
    assert [b["batch"] for b in doc["batches"]] == list(range(steps))  # a dropped batch generated again, once


def test_an_asynchronous_run_stopped_mid_run_goes_on_from_its_last_step_with_its_ledger(tmp_path):
    """SIGTERM once step 0 is saved: the step in flight ends and is saved, the batch being
    generated is dropped; the run given the same directory trains the rest, each sample once."""
    from jigsaw.recipes.grpo import STOPPED_RC

    ckpt, result = tmp_path / "ckpt", tmp_path / "stopped.json"
    proc = subprocess.Popen([sys.executable, "-m", "jigsaw.recipes.grpo", *SMALL, "--steps", "4", "--mode",
                             "one-step-off", "--result", str(result), "--checkpoint-dir", str(ckpt)], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (ckpt / "step-0" / "jigsaw.json").exists() or proc.poll() is not None, 240,
                   "step 0 saved")
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=HANG_S)[1]
    finally:
        proc.kill()
    assert proc.returncode == STOPPED_RC, err[-3000:]
    stopped = json.loads(result.read_text())
    done = len(stopped["steps"])
    assert stopped["stopped"] and 1 <= done < 4 and f"stopped (SIGTERM) after {done} step(s), all saved" in err

    rc, then, err = _recipe(tmp_path, "then", "--steps", "4", "--mode", "one-step-off", "--checkpoint-dir", str(ckpt))
    assert rc == 0, err[-3000:]
    assert then["resumed_steps"] == done and then["steps"][:done] == stopped["steps"] and not then["stopped"]
    _ledger_whole(then, 4, 4)
    # the first batch after it generates under the checkpoint's weights: fresher than the bound asks
    assert then["batches"][done]["weights_version"] == done


def test_an_asynchronous_run_goes_on_from_a_synchronous_ones_checkpoint(tmp_path):
    """A sync checkpoint keeps no ledger: its step n trained batch n under the weights of step n."""
    ckpt = str(tmp_path / "ckpt")
    rc, first, err = _recipe(tmp_path, "sync", "--steps", "1", "--checkpoint-dir", ckpt)
    assert rc == 0, err[-3000:]
    rc, then, err = _recipe(tmp_path, "async", "--steps", "3", "--mode", "fully-async", "--checkpoint-dir", ckpt)
    assert rc == 0, err[-3000:]
    assert then["resumed_steps"] == 1 and then["steps"][:1] == first["steps"]
    assert sorted(u for u, _, _ in then["ledger"]) == list(range(12))
    assert [row for row in then["ledger"] if row[2] == 0] == [[u, 0, 0] for u in range(4)]
    assert [s["step"] for s in then["steps"]] == [0, 1, 2] and [b["batch"] for b in then["batches"]] == [1, 2]
