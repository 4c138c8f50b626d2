"""The GRPO recipe and `jigsaw demo` end to end on this CPU (real processes, real engines), and
the demo's report: medians, spread, pairing by repeat, and when it calls itself unreliable."""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from jigsaw.cli.main import main
from jigsaw.graph.ids import SubStageId
from jigsaw.recipes import demo
from jigsaw.recipes.demo import MODES, DemoConfig, Run, _summarise
from jigsaw.recipes.demo_report import MAX_BUSY_FRAC, doubts, noise, summarise, table, verdict
from jigsaw.recipes.grpo import RecipeConfig
from jigsaw.recipes.grpo_step import _caps


def test_long_tail_caps_are_seeded_bounded_and_skewed():
    cfg = RecipeConfig(max_new_tokens=256, seed=3)
    caps = _caps(cfg, step=0, n=400)
    assert caps == _caps(cfg, step=0, n=400) and caps != _caps(cfg, step=1, n=400)
    assert min(caps) >= 2 and max(caps) == 256  # a few hit the budget
    assert sorted(caps)[200] < 0.3 * 256  # most are short: the median is about 0.2 × budget
    assert _caps(RecipeConfig(long_tail=False, max_new_tokens=64), 0, 5) == [64] * 5


@pytest.mark.timeout(1500)  # a hang detector: about 300 s on an idle 2-core machine, twice that with a core busy
def test_demo_runs_every_mode(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a user's directory, not the repository: the default is relative
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "2", "--prompts", "2", "--group", "2", "--max-new-tokens", "24",
                 "--repeats", "1", "--modes", *MODES, "--out-dir", "demo"]) == 0
    printed = capsys.readouterr().out
    for mode in MODES:
        docs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}-seed*.json"))]
        assert len(docs) == 2 and all(len(d["steps"]) == 2 and d["tokens"] > 0 for d in docs), mode
        assert mode in printed and (out / "logs" / f"{mode}-r1.log").stat().st_size > 0
    assert "one run per mode" in printed  # a single repeat is never called reliable
    assert len((out / "runs.jsonl").read_text().splitlines()) == len(MODES)
    assert (out / "jigsaw-trace-r1.jsonl").exists()
    live_static = [json.loads(line) for line in (out / "static-live-trace.jsonl").read_text().splitlines()]
    halves = [(e["sm_frac"], len(e["data"]["partition"]["cores"])) for e in live_static if e["event"] == "grant"]
    cores = len(os.sched_getaffinity(0))
    assert halves and set(halves) == {(0.5, cores // 2)}  # the daemon's static policy: half the cores, always
    alone = [json.loads(line) for line in (out / "serial-live-trace.jsonl").read_text().splitlines()]
    assert {e["sm_frac"] for e in alone if e["event"] == "grant"} == {1.0}  # every sub-stage on every core
    first = {p: min(e["t_s"] for e in alone if e["pipeline"] == p) for p in ("grpo-seed1", "grpo-seed2")}
    assert max(e["t_s"] for e in alone if e["pipeline"] == "grpo-seed1" and e["event"] == "step") < first["grpo-seed2"]
    from jigsaw.mux.model.slowdown import load_grid
    from jigsaw.sim.calibrate import calibrate
    from jigsaw.trace import Trace

    cal = calibrate(load_grid("cpu/tiny-qwen3"), [Trace.read(out / "serial-live-trace.jsonl")],
                    [Trace.read(out / "static-live-trace.jsonl")], min_matched_s=0.0)
    assert {"reference", "training"} <= {f.kind for f in cal.fits if f.matched == 2}  # same ids in both runs
    # the README's calibration command, on these runs' traces (its demo command is these two modes)
    assert main(["profile", "--calibrate", "demo/serial-live-trace-r1.jsonl", "demo/static-live-trace-r1.jsonl",
                 "--out", "my-cpu.json"]) == 0
    assert load_grid(str(tmp_path / "my-cpu.json")).model == "tiny-qwen3"
    events = [json.loads(line) for line in (out / "jigsaw-trace.jsonl").read_text().splitlines()]
    granted = {e["pipeline"] for e in events if e["event"] == "grant"}
    assert granted == {"grpo-seed1", "grpo-seed2"}  # both pipelines went through the daemon
    kinds = {SubStageId.parse(e["substage"]).kind.value for e in events if e["event"] == "grant"}
    assert {"reference", "training"} <= kinds and any(k.startswith("rollout_") for k in kinds)
    releases = [e for e in events if e["event"] == "release" and e["data"].get("flops")]
    assert releases  # FLOPs reach the trace, so the timeline has an MFU
    png = out / "jigsaw-timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "jigsaw-timeline.html").exists()
    assert Path(out / "daemon.log").exists()


def _result(tmp_path: Path, name: str, latencies: list[float], tokens: list[int], fell: int = 0) -> Path:
    steps, t = [], 100.0
    for lat, tok in zip(latencies, tokens):
        steps.append({"latency_s": lat, "tokens": tok, "start_s": t, "end_s": t + lat})
        t += lat
    doc = {"name": name, "tokens": sum(tokens), "steps": steps,
           "fell_open": [{"kind": "training", "dp_rank": 0, "step": i, "substage": "", "reason": "unreachable"}
                         for i in range(fell)]}
    (path := tmp_path / f"{name}.json").write_text(json.dumps(doc))
    return path


def test_warm_up_steps_are_left_out_of_time_and_tokens(tmp_path):
    a = _result(tmp_path, "a", [100.0, 2.0, 2.0], [7, 10, 10])  # a 100 s warm-up must not count
    b = _result(tmp_path, "b", [50.0, 1.0, 3.0], [5, 20, 20])
    serial = _summarise("serial", 0, 200.0, [a, b], warmup_steps=1)
    assert serial.steps_s == pytest.approx(4.0 + 4.0) and serial.tokens == 60
    concurrent = _summarise("naive", 0, 200.0, [a, b], warmup_steps=1)
    assert concurrent.steps_s == pytest.approx(104.0 - 50.0)  # earliest measured start to latest end
    assert concurrent.step_latency_s == {"a": 2.0, "b": 2.0}
    assert concurrent.step_tokens == ((7, 10, 10), (5, 20, 20))


def test_sub_stages_that_fell_open_are_counted_for_the_jigsaw_run_only(tmp_path):
    paths = [_result(tmp_path, "a", [1, 1], [5, 5], fell=2), _result(tmp_path, "b", [1, 1], [5, 5], fell=1)]
    assert _summarise("jigsaw", 0, 9.0, paths, 1).fell_open == 3
    assert _summarise("serial", 0, 9.0, paths, 1).fell_open == 0  # no daemon there: uncontrolled by design
    from rich.console import Console

    runs = [_summarise("jigsaw", 0, 9.0, paths, 1), _summarise("serial", 0, 9.0, paths, 1)]
    console = Console(width=200, record=True)
    console.print(table(summarise(runs)))
    row = next(line for line in console.export_text().splitlines() if "jigsaw" in line)
    assert row.rstrip(" │").endswith("3")  # the last column: sub-stages that fell open


def _run(mode: str, rep: int, tps: float, **kw) -> Run:
    return Run(mode=mode, repeat=rep, wall_s=30.0, steps_s=10.0, tokens=round(tps * 10), step_tokens=((1, 2),),
               step_latency_s={"a": 1.0}, **kw)


def test_ratios_to_serial_are_paired_by_repeat_and_the_median_is_reported():
    # repeat 1 ran on a slow machine: serial and jigsaw both slow; pairing keeps the ratio at 2
    runs = [_run("serial", 0, 100), _run("jigsaw", 0, 200), _run("serial", 1, 50), _run("jigsaw", 1, 100),
            _run("serial", 2, 100), _run("jigsaw", 2, 200)]
    by = {s.mode: s for s in summarise(runs)}
    assert by["jigsaw"].vs_serial == pytest.approx((2.0, 2.0, 2.0))
    assert by["jigsaw"].tokens_per_s == pytest.approx(200) and by["jigsaw"].min_tokens_per_s == pytest.approx(100)


def test_a_tight_quiet_comparison_is_reliable_and_each_doubt_is_named():
    quiet = [_run(m, r, base * (1 + 0.02 * r)) for r in range(3) for m, base in (("serial", 100), ("jigsaw", 150))]
    assert doubts(quiet, summarise(quiet)) == [] and noise(summarise(quiet)) == []
    assert verdict(quiet, summarise(quiet))[1].startswith("reliable")

    # one jigsaw repeat 60% off the others: noisy, yet every repeat still ranks jigsaw above serial
    spread = quiet[:-1] + [_run("jigsaw", 2, 250)]
    assert doubts(spread, summarise(spread)) == []
    assert [n.split(":")[0] for n in noise(summarise(spread))] == ["jigsaw"]
    busy = [*quiet[:-1], replace(quiet[-1], idle_busy_frac=MAX_BUSY_FRAC + 0.2)]
    assert any("busy" in d for d in doubts(busy, summarise(busy)))
    different = [*quiet[:-1], replace(quiet[-1], step_tokens=((1, 3),))]
    assert any("different work" in d for d in doubts(different, summarise(different)))
    straddle = [_run("serial", r, 100) for r in range(3)] + [_run("jigsaw", r, t) for r, t in enumerate((95, 100, 105))]
    assert any("whether jigsaw is faster than serial" in d for d in doubts(straddle, summarise(straddle)))
    assert any("UNRELIABLE" in line for line in verdict(busy, summarise(busy)))


def test_jigsaw_is_compared_with_every_other_mode_repeat_by_repeat():
    # naive-fair's and jigsaw's ranges overlap, but jigsaw wins every repeat: settled
    runs = [_run("serial", r, 100) for r in range(3)]
    runs += [_run("naive-fair", r, t) for r, t in enumerate((200, 240, 280))]
    runs += [_run("jigsaw", r, t) for r, t in enumerate((210, 250, 290))]
    assert doubts(runs, summarise(runs)) == []
    runs[-1] = _run("jigsaw", 2, 270)  # the last repeat goes the other way
    (doubt,) = doubts(runs, summarise(runs))
    assert "whether jigsaw is faster than naive-fair" in doubt and "0.96-1.05" in doubt


def test_modes_are_interleaved_and_rotated_across_repeats(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(demo, "_run_mode", lambda mode, rep, cfg: order.append(mode) or _run(mode, rep, 1.0))
    monkeypatch.setattr(demo, "machine_busy_frac", lambda: 0.0)
    runs = demo.run_demo(DemoConfig(repeats=3, modes=("serial", "naive", "jigsaw"), out_dir=tmp_path), say=lambda s: 0)
    assert order == ["serial", "naive", "jigsaw", "naive", "jigsaw", "serial", "jigsaw", "serial", "naive"]
    assert [r.repeat for r in runs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_bad_demo_configs_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="unknown demo modes"):
        demo.run_demo(DemoConfig(modes=("serial", "fast"), out_dir=tmp_path))
    with pytest.raises(ValueError, match="warmup"):
        demo.run_demo(DemoConfig(steps=1, warmup_steps=1, out_dir=tmp_path))
    with pytest.raises(ValueError, match="math, agentic or async"):
        demo.run_demo(DemoConfig(workload="swe", out_dir=tmp_path))
    with pytest.raises(ValueError, match="own recipe"):
        demo.run_demo(DemoConfig(workload="agentic", framework="gpu", out_dir=tmp_path))


def test_the_agentic_workload_gives_the_first_pipeline_its_tool_turns(tmp_path):
    cfg = DemoConfig(workload="agentic", seeds=(1, 2, 3))
    cmds = [demo._pipeline_cmd(cfg, seed, tmp_path / "r.json") for seed in cfg.seeds]
    turns = [cmd[cmd.index("--tool-turns") + 1] if "--tool-turns" in cmd else None for cmd in cmds]
    assert turns == [str(demo.AGENTIC_TURNS), None, None]
    assert "--tool-turns" not in demo._pipeline_cmd(DemoConfig(), 1, tmp_path / "r.json")


def test_the_async_workload_runs_a_one_step_off_pipeline_beside_a_sync_one(tmp_path, capsys, monkeypatch):
    cmds = [demo._pipeline_cmd(DemoConfig(workload="async"), seed, tmp_path / "r.json") for seed in (1, 2)]
    assert [cmd[cmd.index("--mode") + 1] if "--mode" in cmd else None for cmd in cmds] == ["one-step-off", None]
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--async", "--steps", "3", "--prompts", "2", "--group", "2",
                 "--max-new-tokens", "24", "--repeats", "1", "--modes", "jigsaw", "--out-dir", "demo"]) == 0
    one, other = (json.loads((tmp_path / "demo" / f"jigsaw-seed{s}.json").read_text()) for s in (1, 2))
    assert one["mode"] == "one-step-off" and "mode" not in other
    assert sorted(u for u, _, _ in one["ledger"]) == list(range(3 * 4))  # every sample trained once
    assert [s["staleness"] for s in one["steps"]] == [0, 1, 1]  # batch n under the weights of step n - 1
    trace = (tmp_path / "demo" / "jigsaw-trace-r1.jsonl").read_text()
    assert '"grpo-seed1.train"' in trace and "tokens/s" in capsys.readouterr().out


def test_static_gives_each_pipeline_its_own_equal_cores():
    from jigsaw.recipes.demo import static_cores

    for n, k in ((2, 2), (5, 2), (8, 3), (16, 4)):
        shares = static_cores(tuple(range(n)), k)
        flat = [c for s in shares for c in s]
        assert sorted(flat) == list(range(n)) and len(set(flat)) == n  # disjoint, every core used
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError, match="its own cores"):
        static_cores((0,), 2)


@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_a_static_pipeline_and_every_process_it_starts_stay_on_its_cores():
    import subprocess
    import sys

    from jigsaw.recipes.demo import pinned

    core = min(os.sched_getaffinity(0))
    child = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
             "print(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
             "capture_output=True, text=True).stdout.strip())")
    done = subprocess.run([sys.executable, "-c", child], preexec_fn=pinned((core,)), capture_output=True, text=True,
                          timeout=50)
    assert done.stdout.split() == [f"[{core}]", f"[{core}]"], done.stderr


def _cpu_quota_or_skip(cpus: float):
    from jigsaw.mux.partition.cpuquota import CpuQuota, QuotaUnavailable

    try:
        return CpuQuota.create(f"jigsaw-test-{os.getpid()}", cpus)
    except QuotaUnavailable as exc:
        pytest.skip(f"no CPU quota here: {exc}")


@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores for a cap below what it could use")
def test_a_cpu_quota_holds_a_process_and_everything_it_starts_to_its_share():
    """The static split of more pipelines than cores: a pipeline and the processes it starts
    together get at most their share of CPU time, on whatever cores (an upper bound, whatever
    else loads the machine; without the cap two busy processes would use two CPUs)."""
    import subprocess
    import sys

    quota = _cpu_quota_or_skip(0.5)
    burn = ("import os, time\nw = time.time()\nwhile time.time() - w < 1.5: pass\n"
            "print(sum(os.times()[:2]) if os.fork() else os._exit(0))")
    parent = ("import os, subprocess, sys, time\nw = time.time()\n"
              f"kids = [subprocess.Popen([sys.executable, '-c', {burn!r}], stdout=subprocess.PIPE, text=True)"
              " for _ in range(2)]\n"
              "cpu = sum(float(k.communicate()[0]) for k in kids)\nprint(cpu, time.time() - w)")
    try:
        done = subprocess.run([sys.executable, "-c", parent], preexec_fn=quota.join, capture_output=True, text=True,
                              timeout=50)
    finally:
        quota.remove()
    cpu_s, wall_s = map(float, done.stdout.split())
    assert cpu_s <= 0.5 * wall_s + 0.15, (cpu_s, wall_s, done.stderr)  # two busy children share half a CPU


@pytest.mark.timeout(900)
def test_three_pipelines_run_statically_split_by_cpu_time_and_under_jigsaw(tmp_path):
    """The three-pipeline mode: more pipelines than this machine's cores, static caps each at an
    equal share of CPU time (nothing pins), and the daemon schedules all three."""
    cores = len(os.sched_getaffinity(0))
    if cores >= 3:
        pytest.skip("static pins three pipelines to cores of their own here: no CPU-time split to test")
    _cpu_quota_or_skip(cores / 3).remove()
    runs = demo.run_demo(DemoConfig(seeds=(1, 2, 3), steps=2, prompts=2, group=2, max_new_tokens=16, repeats=1,
                                    modes=("static", "jigsaw"), out_dir=tmp_path), say=lambda _: None)
    assert [r.mode for r in runs] == ["static", "jigsaw"] and all(len(r.step_tokens) == 3 for r in runs)
    assert runs[0].step_tokens == runs[1].step_tokens  # the same work both ways
    events = [json.loads(line) for line in (tmp_path / "jigsaw-trace.jsonl").read_text().splitlines()]
    assert {e["pipeline"] for e in events if e["event"] == "grant"} == {"grpo-seed1", "grpo-seed2", "grpo-seed3"}
    assert not list(Path("/sys/fs/cgroup").glob(f"**/jigsaw-demo-{os.getpid()}-*"))  # the caps are gone
