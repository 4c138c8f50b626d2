"""bench/gpu_check.py, the one command prepared for a GPU machine, kept working on a CPU.

The dry run runs every step for real on this CPU, the GPU faked (FakeGreenPartitions, FakeCensus)
or the CPU bench standing in; the two-process SM-id comparison is checked against fakes whose
sides share SMs, or whose worker fails.
"""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jigsaw.mux.partition import smid

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import _gpu_check_models as gmodels  # noqa: E402  (bench/ is not a package)
import _gpu_check_steps as gsteps  # noqa: E402
import gpu_check  # noqa: E402


class BrokenCensus:
    """A census whose worker cannot open its partitions (as on a driver without green contexts)."""

    def __init__(self, device, fracs):
        raise RuntimeError("no green contexts here")


@pytest.mark.timeout(240)
def test_dry_run_runs_every_step_and_reports_disjoint_sides(tmp_path):
    res = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=230, cwd=ROOT, check=False)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert "[gpu_check +" in res.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["ok"] is True
    steps = {s["name"]: s for s in report["steps"]}
    assert tuple(steps) == gpu_check.STEP_NAMES
    pipelines_absent = not (BENCH / "_gpu_pipelines.py").is_file()
    for name, step in steps.items():
        allowed = {"ok", "unavailable"} if name in ("pipelines", "engines") and pipelines_absent else {"ok"}
        assert step["status"] in allowed, (name, step["note"], step["error"])
    rows = steps["smid2"]["rows"]
    assert [r["sigma"] for r in rows] == list(gsteps.LEVELS)
    for r in rows:  # each side on exactly its SMs, none shared
        assert r["ok"] and r["shared_sms"] == 0, r
        assert (r["side0_ids"], r["side1_ids"]) == (r["side0_sms"], r["side1_sms"]), r
        assert r["side0_sms"] + r["side1_sms"] <= gsteps.FAKE_NUM_SMS
    if not pipelines_absent:  # the engines' processes took green sides of the fake GPU
        assert steps["engines"]["rows"] and all(r["green_grants"] > 0 and r["fell_open"] == 0
                                                for r in steps["engines"]["rows"]), steps["engines"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {name}: " in markdown for name in gpu_check.STEP_NAMES)
    assert "| mode | sigma |" in markdown


def test_two_process_comparison_fails_when_the_two_sides_share_sms():
    fast = {"repeats": 1, "spin_ns": 100_000, "timeout_s": 60.0}
    shared = smid.two_process_census(gsteps.LEVELS, census=functools.partial(gsteps.FakeCensus, overlap_sms=4),
                                     **fast)
    assert not shared.ok and len(shared.budgets) == len(gsteps.LEVELS)
    for b in shared.budgets:
        assert len(b.census.overlap) == 4 and not b.ok, b.describe()
        assert all(s.within for s in b.census.sides)  # the counts fit: only the overlap gives it away
        assert "FAIL" in b.describe() and "4 shared" in b.describe()
    honest = smid.two_process_census(gsteps.LEVELS, census=gsteps.FakeCensus, **fast)
    assert honest.ok and all(not b.census.overlap for b in honest.budgets)


def test_a_failing_census_worker_raises_with_its_traceback():
    with pytest.raises(smid.CensusError, match="no green contexts here"):
        smid.two_process_census((0.5,), census=BrokenCensus, repeats=1, timeout_s=60.0)


def test_step_lists_are_checked_and_tables_render_plain_cells():
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "env,nosuchstep"])
    assert gpu_check.parse_args(["--only", "env, smid2"]).only == ("env", "smid2")
    table = gpu_check.markdown_table([{"a": 1.23456, "b": True}, {"b": None, "c": "x|y"}])
    assert table == ["| a | b | c |", "|---|---|---|", "| 1.235 | yes |  |", "|  |  | x\\|y |"]
    assert gpu_check._plain({"x": float("inf"), "y": (1, 2)}) == {"x": "inf", "y": [1, 2]}


def test_a_grid_compared_with_itself_differs_nowhere():
    from jigsaw.mux.model.slowdown import SlowdownGrid
    from jigsaw.profiles import SHIPPED_DIR

    prior = SlowdownGrid.load(SHIPPED_DIR / "h100" / "qwen3-0.6b.prior.json")
    rows = gmodels.compare_grids(prior, prior)
    assert [r["kind"] for r in rows] == list(prior.kinds)
    points = len(prior.kinds) * len(prior.sm_levels) * len(prior.mem_levels)
    for r in rows:
        assert r["pair_max_rel"] == 0 and r["alone_max_rel"] == 0, r
        assert r["pair_points"] + r["not_comparable"] == points and r["at_prior_levels"] == r["pair_points"]
