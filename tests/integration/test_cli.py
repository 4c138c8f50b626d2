"""`jigsaw` CLI: subcommands, light imports, clear errors."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jigsaw.cli.main import COMMANDS, main
from jigsaw.mux.model.slowdown import load_grid
from jigsaw.profiles import SHIPPED_DIR

ROOT = Path(__file__).resolve().parents[2]
PRIOR = SHIPPED_DIR / "h100" / "qwen3-4b.prior.json"


def _run(*args):
    return subprocess.run([sys.executable, "-m", "jigsaw.cli.main", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_help_lists_the_subcommands_without_torch_or_scipy():
    probe = ("import sys\nfrom jigsaw.cli.main import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('LOADED', 'torch' in sys.modules, 'scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in COMMANDS:
        assert name in out.stdout
    assert "LOADED False False" in out.stdout  # neither for `jigsaw sim --help`


def test_prior_writes_a_valid_labelled_grid(tmp_path):
    dest = tmp_path / "g.json"
    assert main(["prior", "--device", "a100", "--model", "qwen3-0.6b", "--prior.fsdp-degree", "2",
                 "--out", str(dest)]) == 0
    grid = load_grid(dest)
    assert grid.device.sku.startswith("A100") and grid.model == "qwen3-0.6b"
    assert grid.source["kind"] == "analytic-prior"
    assert grid.source["parameters"]["config"]["fsdp_degree"] == 2


def test_inspect_prints_tables_and_rejects_a_malformed_file(tmp_path):
    ok = _run("inspect", str(PRIOR), "--pair", "rollout_tail", "training")
    assert ok.returncode == 0, ok.stderr
    assert "valid v1 grid" in ok.stdout and "rollout_tail beside training" in ok.stdout
    bad = json.loads(PRIOR.read_text())
    bad["alone"]["training"][0][0] = 0.2
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    res = _run("inspect", str(path))
    assert res.returncode == 2
    assert str(path) in res.stderr and "alone.training[0][0]" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("argv", [["inspect", "/nonexistent.json"], ["prior", "--model", "gpt-9"]])
def test_bad_arguments_fail_cleanly(argv):
    res = _run(*argv)
    assert res.returncode != 0 and "Traceback" not in res.stderr


def test_sim_compares_policies_and_writes_a_trace(tmp_path):
    out = tmp_path / "trace.jsonl"
    res = _run("sim", "--workload", "qwen3-0.6b-gsm8k,qwen3-0.6b-gsm8k", "--gpus", "2", "--steps", "2",
               "--policy", "serial,jigsaw", "--out", str(out), "--breakdown")
    assert res.returncode == 0, res.stderr
    assert "serial" in res.stdout and "jigsaw" in res.stdout and "lower bound" in res.stdout
    assert "device time went" in res.stdout and "work per device-second" in res.stdout
    assert "[1/2] serial: " in res.stderr and "[2/2] jigsaw: " in res.stderr  # progress, also off a terminal
    from jigsaw.trace import Trace

    events = Trace.read(out).events
    assert {e.event for e in events} >= {"grant", "release", "step"}
    assert sum(e.event == "step" for e in events) == 4


def test_a_policy_that_cannot_run_the_deployment_is_a_row_not_the_end():
    # static: each 32B training (optimizer offloaded) needs 42.3 GiB, more than half an 80 GiB A100
    mix = "qwen3-32b-math,qwen3-32b-math"
    res = _run("sim", "--workload", mix, "--steps", "1", "--policy", "static,serial", "--no-bound", "--no-trace")
    assert res.returncode == 0, res.stderr
    rows = {ln.split("│")[1].strip(): ln for ln in res.stdout.splitlines() if ln.count("│") > 3}
    assert "infeasible" in rows["static"] and "1.00" in rows["serial"]
    said = " ".join(res.stdout.split())
    assert "static: training of p0-qwen3-32b-math needs 42.3 GiB; its share of a device is 40.0 GiB" in said
    assert "Traceback" not in res.stderr
    alone = _run("sim", "--workload", mix, "--steps", "1", "--policy", "static", "--no-bound", "--no-trace")
    assert alone.returncode != 0 and "no policy can run this deployment" in alone.stderr


def test_sim_replays_a_recorded_trace_under_every_policy(tmp_path):
    out = tmp_path / "trace.jsonl"
    rec = _run("sim", "--workload", "qwen3-0.6b-gsm8k,qwen3-0.6b-gsm8k", "--gpus", "2", "--steps", "2",
               "--policy", "serial", "--no-bound", "--out", str(out))
    assert rec.returncode == 0, rec.stderr
    res = _run("sim", "--replay", str(out), "--policy", "all")
    assert res.returncode == 0, res.stderr
    assert all(p in res.stdout for p in ("serial", "split", "static", "muxserve", "rollmux", "hrrs", "greedy",
                                         "jigsaw"))
    assert "recorded makespan" in res.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    failed = _run("sim", "--replay", str(bad))
    assert failed.returncode != 0 and "bad.jsonl:1" in failed.stderr and "Traceback" not in failed.stderr


def test_sim_lists_workloads_and_rejects_unknown_policies():
    listed = _run("sim", "--list")
    assert listed.returncode == 0 and "qwen3-4b-search-r1" in listed.stdout
    bad = _run("sim", "--policy", "fifo", "--steps", "1")
    assert bad.returncode == 2 and "unknown policy" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.timeout(120)
def test_no_flag_help_states_its_default_twice():
    """A docstring that says its default beside tyro's own "(default: ...)" reads as two answers
    ("(default: profiles/cpu/tiny-qwen3.json). (default: None)", as a user saw it)."""
    from jigsaw.cli.main import COMMANDS

    for name in COMMANDS:
        res = _run(name, "--help")
        assert res.returncode == 0, res.stderr
        text = " ".join(res.stdout.replace("│", " ").split())
        twice = re.search(r"\(default: [^)]*\)\.?\s*\(default:|default: [^()]*\(default:", text)
        assert twice is None, f"jigsaw {name} --help: {twice.group(0)!r}"


def test_a_flag_its_config_section_refuses_is_a_usage_error_not_a_traceback(capsys):
    # SimConfig.__post_init__ runs while tyro builds the arguments, before any command runs
    assert main(["sim", "--workload", "qwen3-0.6b-gsm8k", "--placement-confirm-frac", "2"]) == 2
    err = capsys.readouterr().err
    assert "jigsaw: error: --placement-confirm-frac must be in [0, 1), got 2.0" in err and "Traceback" not in err
