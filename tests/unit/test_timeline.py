"""`jigsaw timeline`: intervals from grants/releases, utilisation and MFU numbers, the three
outputs (PNG, Chrome trace, HTML) from a simulated trace, what the PNG draws (colour by kind,
CPU labels, start-up cropped), the HTML tables, the latest daemon trace by default, and clean
errors."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from factories import colocated

from jigsaw import timeline as tlm
from jigsaw.cli.main import main
from jigsaw.timeline.model import CROP_MARGIN_FRAC
from jigsaw.trace import Trace, TraceEvent

ROOT = Path(__file__).resolve().parents[2]
A, B = "pa", "pb"


def _ev(t_s, event, pipeline, substage="", device=None, sm_frac=0.0, **data):
    return TraceEvent(t_s=t_s, event=event, pipeline=pipeline, substage=substage, device=device,
                      sm_frac=sm_frac, data=data)


def _meta(pipeline, **data):
    """A `pipeline` event (its data may hold a key named device)."""
    return TraceEvent(t_s=0.0, event="pipeline", pipeline=pipeline, data=data)


def _hand_trace(*, release_flops: bool = True) -> Trace:
    """Device 0: A at 0.5 then 0.75 (regrant at 2 s) until 4 s; B at 0.25 from 0 to 6 s.
    Device 1: placed but never granted.  Peak 1 TFLOP/s."""
    extra = {"flops": 2e12, "tokens": 100} if release_flops else {}
    return Trace([
        _meta(A, peak_flops=1e12, devices=[0, 1]),
        _meta(B, peak_flops=1e12, devices=[0]),
        _ev(0.0, "grant", A, f"{A}/0/r0/rollout_prefill/0", 0, 0.5),
        _ev(0.0, "grant", B, f"{B}/0/r0/training/0", 0, 0.25),
        _ev(2.0, "grant", A, f"{A}/0/r0/rollout_prefill/0", 0, 0.75),
        _ev(4.0, "release", A, "", 0, 0.75, **extra),
        _ev(4.0, "step", A, latency_s=4.0, tokens=50, flops=9e12),  # ignored when A's releases carry FLOPs
        _ev(6.0, "release", B, "", 0, 0.25),
        _ev(6.0, "step", B, latency_s=6.0, tokens=70, flops=1.2e12),
    ])


def test_grant_regrant_release_give_the_expected_utilisation():
    ivs = tlm.intervals(_hand_trace())
    got = [(iv.pipeline, iv.device, iv.start_s, iv.end_s, iv.sm_frac) for iv in ivs]
    assert got == [(A, 0, 0.0, 2.0, 0.5), (B, 0, 0.0, 6.0, 0.25), (A, 0, 2.0, 4.0, 0.75)]
    assert ivs[0].holding == ivs[2].holding != ivs[1].holding  # the regrant continues A's holding
    tl = tlm.build(_hand_trace())
    s = tl.series[0]
    assert s.times_s == (0.0, 2.0, 4.0, 6.0)
    assert s.util_frac == pytest.approx((0.75, 1.0, 0.25, 0.0))
    assert s.share_frac[A] == pytest.approx((0.5, 0.75, 0.0, 0.0))
    assert tl.devices == (0, 1) and tl.series[1].times_s == ()
    # device 0: 0.75·2 + 1·2 + 0.25·2 = 4 device-s of 6; device 1 idle
    assert tlm.integral(s.times_s, s.util_frac, 0.0, 6.0) == pytest.approx(4.0)
    assert tl.mean_util_frac == pytest.approx(4.0 / 12.0)
    assert tlm.binned(s.times_s, s.util_frac, [0.0, 3.0, 6.0]) == pytest.approx([2.5 / 3, 1.5 / 3])


def test_a_new_substage_closes_the_previous_interval_and_the_trace_end_closes_the_rest():
    trace = Trace([
        _ev(0.0, "release", A, "", 0),  # releases nothing: ignored
        _ev(1.0, "grant", A, "a/0/r0/rollout_prefill/0", 0, 1.0),
        _ev(2.0, "grant", A, "a/0/r0/rollout_tail/0", 0, 1.0),  # no release in between (the simulator does this)
        _ev(3.0, "grant", B, "b/0/r0/training/0", 1, 1.0),
        _ev(5.0, "host", A, "a/0/r0/reward/0", end_s=5.5),
    ])
    got = [(iv.kind, iv.start_s, iv.end_s) for iv in tlm.intervals(trace)]
    assert got == [("rollout_prefill", 1.0, 2.0), ("rollout_tail", 2.0, 5.0), ("training", 3.0, 5.0)]
    # two unpartitioned sub-stages (both at σ = 1) on one device are drawn as halves
    both = Trace([_ev(0.0, "grant", A, "x", 0, 1.0), _ev(0.0, "grant", B, "y", 0, 1.0), _ev(1.0, "release", A, "", 0)])
    s = tlm.build(both).series[0]
    assert s.share_frac[A][0] == s.share_frac[B][0] == 0.5 and s.util_frac[0] == 1.0


def test_mfu_from_release_flops_and_from_step_flops_spread():
    tl = tlm.build(_hand_trace())
    assert tl.flops_source == {A: "release", B: "step"}
    flops = {(iv.pipeline, iv.start_s): iv.flops for iv in tl.intervals}
    # A's release FLOPs spread over its holding by length; B's step spread over its window
    assert flops == pytest.approx({(A, 0.0): 1e12, (A, 2.0): 1e12, (B, 0.0): 1.2e12})
    assert tl.series[0].mfu_frac == pytest.approx((0.7, 0.7, 0.2, 0.0))
    assert tl.mean_mfu_frac == pytest.approx(3.2e12 / (2 * 6.0 * 1e12))
    summary = {s.name: s for s in tlm.pipeline_summary(tl)}
    assert summary[A].busy_device_s == pytest.approx(4.0) and summary[A].mfu_frac == pytest.approx(0.5)
    assert summary[B].tokens == 70 and summary[B].mfu_frac == pytest.approx(0.2)
    # without release FLOPs, A's step FLOPs are spread instead
    assert tlm.build(_hand_trace(release_flops=False)).flops == pytest.approx(9e12 + 1.2e12)


def test_step_flops_follow_interval_length_inside_the_step_window():
    trace = Trace([
        _ev(0.0, "grant", A, "s0", 0, 1.0), _ev(3.0, "release", A, "", 0),
        _ev(1.0, "grant", A, "s1", 1, 1.0), _ev(4.0, "release", A, "", 1),
        _ev(4.0, "step", A, latency_s=2.0, flops=3.0),  # window [2, 4]: 1 s on device 0, 2 s on device 1
        _ev(9.0, "step", A, latency_s=1.0, flops=5.0),  # window [8, 9] holds no interval
    ])
    ivs, lost = tlm.attribute_flops(trace, tlm.intervals(trace))
    assert [iv.flops for iv in ivs] == pytest.approx([1.0, 2.0])
    assert lost == 5.0


def test_peaks_come_from_the_device_name_peak_flops_or_the_override():
    trace = Trace([_meta(A, device="h100", devices=[0]), _meta(B, device="a100", peak_flops=5e14, devices=[1]),
                   _ev(0.0, "grant", A, "x", 0, 1.0), _ev(0.0, "grant", B, "y", 1, 1.0),
                   _ev(1.0, "step", A, latency_s=1.0, flops=1e12)])
    assert tlm.device_peaks(trace, [0, 1]) == {0: 989e12, 1: 5e14}
    assert tlm.device_peaks(trace, [0, 1, 2], 1e12) == {0: 1e12, 1: 1e12, 2: 1e12}
    unknown = Trace([_meta(A, device="tpu"), _ev(0.0, "grant", A, "x", 0, 1.0),
                     _ev(1.0, "step", A, latency_s=1.0, flops=1e12)])
    tl = tlm.build(unknown)
    assert tl.mean_mfu_frac is None and tl.series[0].mfu_frac is None
    assert "--peak-tflops" in tlm.describe(tl)
    assert tlm.build(unknown, peak_flops=2e12).mean_mfu_frac == pytest.approx(0.5)


# ------------------------------------------------------------------ outputs of a simulated trace


@pytest.fixture(scope="module")
def sim_trace(tmp_path_factory) -> Path:
    from jigsaw.sim.run import simulate

    result = simulate(colocated(workload=("qwen3-0.6b-gsm8k", "qwen3-0.6b-math"), gpus=2, steps=2))
    path = tmp_path_factory.mktemp("trace") / "sim.jsonl"
    result.trace.write(path)
    return path


def test_png_is_written_through_the_cli(sim_trace, tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main(["timeline", str(sim_trace), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    line = capsys.readouterr().out
    assert f"wrote {out}" in line and "mean utilisation" in line and "mean MFU" in line


def test_many_devices_draw_heatmaps(sim_trace, monkeypatch):
    tl = tlm.load(sim_trace)
    rows = tlm.png_bytes(tl)
    monkeypatch.setattr("jigsaw.timeline.draw.MAX_ROWS", 1)
    heat = tlm.png_bytes(tl)
    assert heat[:4] == b"\x89PNG" and heat != rows


def test_chrome_trace_is_valid_and_has_an_interval_per_grant(sim_trace, tmp_path):
    out = tmp_path / "t.json"
    assert main(["timeline", str(sim_trace), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    tlm.validate_chrome_trace(doc)
    assert doc["displayTimeUnit"] == "ms"
    events = Trace.read(sim_trace).events
    grants = [e for e in events if e.event == "grant"]
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "device"]
    assert len(xs) == len(grants)  # every grant opens one interval, closed by a regrant or a release
    assert sorted(x["args"]["substage"] for x in xs) == sorted(g.substage for g in grants)
    assert sum(x["dur"] for x in xs) > 0
    names = {(e["name"], e["args"]["name"]) for e in doc["traceEvents"] if e["ph"] == "M" and "name" in e["args"]}
    assert {("process_name", "GPU 0"), ("process_name", "GPU 1")} <= names
    assert {("thread_name", e.pipeline) for e in events if e.event == "pipeline"} <= names
    counters = {e["name"] for e in doc["traceEvents"] if e["ph"] == "C"}
    assert counters == {"SM share", "MFU"}
    migrations = sum(e.event == "migration" for e in events)
    assert sum(e["ph"] == "i" for e in doc["traceEvents"]) == migrations


@pytest.mark.parametrize("bad, problem", [
    ({"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 1.0}, "dur"),
    ({"ph": "Z", "name": "a", "pid": 0, "ts": 1.0}, "ph must be"),
    ({"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": -1.0, "dur": 1.0}, "ts must be"),
    ({"ph": "X", "name": "a", "pid": True, "tid": 0, "ts": 1.0, "dur": 1.0}, "pid"),
    ({"ph": "C", "name": "u", "pid": 0, "ts": 1.0, "args": {"u": "high"}}, "counter args"),
    ({"ph": "C", "name": "u", "pid": 0, "ts": 1.0, "args": {"u": math.nan}}, "counter args"),
    ({"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {}}, "args.name"),
    ({"ph": "i", "name": "m", "pid": 0, "ts": 1.0, "s": "x"}, "scope"),
])
def test_the_validator_rejects_malformed_events(bad, problem):
    good = {"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 0.0, "dur": 1.0, "args": {}}
    tlm.validate_chrome_trace({"traceEvents": [good], "displayTimeUnit": "ms"})
    with pytest.raises(ValueError, match=problem):
        tlm.validate_chrome_trace({"traceEvents": [good, bad], "displayTimeUnit": "ms"})
    with pytest.raises(ValueError, match="traceEvents"):
        tlm.validate_chrome_trace({"events": []})


def test_html_is_self_contained_with_a_row_per_pipeline(sim_trace, tmp_path):
    from jigsaw.cli.timeline import Args, run

    out = tmp_path / "t.html"
    assert run(Args(trace=sim_trace, out=out)) == 0
    page = out.read_text()
    assert page.startswith("<!doctype html>") and 'src="data:image/png;base64,' in page
    assert "http://" not in page and "https://" not in page and "<script" not in page
    for e in Trace.read(sim_trace).events:
        if e.event == "pipeline":
            assert f"<tr><td>{e.pipeline}</td>" in page


def test_devices_subset(sim_trace, tmp_path):
    tl = tlm.load(sim_trace, devices=[1])
    assert tl.devices == (1,) and {iv.device for iv in tl.intervals} == {1}
    with pytest.raises(ValueError, match="no device"):
        tlm.load(sim_trace, devices=[7])


# ------------------------------------------------------------------ errors


def test_bad_suffix_and_malformed_traces_fail_cleanly(sim_trace, tmp_path, capsys):
    from jigsaw.cli.timeline import Args, run

    with pytest.raises(ValueError, match="unknown suffix '.pdf'"):
        run(Args(trace=sim_trace, out=tmp_path / "t.pdf"))
    assert main(["timeline", str(sim_trace), "--out", str(tmp_path / "t.svg")]) == 2
    assert not (tmp_path / "t.svg").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t_s": 0, "event": "grant", "pipeline": "a", "device": 0}\nnot json\n')
    assert main(["timeline", str(bad), "--out", str(tmp_path / "t.png")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"t_s": 0, "event": "step", "pipeline": "a", "data": {"latency_s": 1}}\n')
    with pytest.raises(ValueError, match="no grant events"):
        tlm.load(empty)
    nodev = tmp_path / "nodev.jsonl"
    nodev.write_text('{"t_s": 0, "event": "grant", "pipeline": "a", "substage": "x"}\n')
    with pytest.raises(ValueError, match="names no device"):
        tlm.load(nodev)
    with pytest.raises(ValueError, match="cannot read trace"):
        tlm.load(tmp_path / "missing.jsonl")
    typed = tmp_path / "typed.jsonl"
    typed.write_text('{"t_s": "soon", "event": "grant", "pipeline": "a", "device": 0}\n')
    with pytest.raises(ValueError, match="trace event 1 \\(grant\\): bad t_s 'soon'"):
        tlm.load(typed)


@pytest.mark.timeout(120)
def test_help_does_not_import_matplotlib():
    probe = ("import sys\nfrom jigsaw.cli.main import main\n"
             "for argv in (['--help'], ['timeline', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('LOADED', 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--peak-tflops" in out.stdout and "LOADED False" in out.stdout


# ------------------------------------------------------------------ what the PNG draws


def _two_kinds_trace(*, first_grant_s: float = 0.0, a: str = A) -> Trace:
    """Device 0 from first_grant_s: `a` rolls out (2 s) then trains (2 s) at 0.5; B trains 4 s at 0.5."""
    t = first_grant_s
    return Trace([
        _meta(a, devices=[0]), _meta(B, devices=[0]),
        _ev(t, "grant", a, f"{a}/0/r0/rollout_prefill/0", 0, 0.5),
        _ev(t, "grant", B, f"{B}/0/r0/training/0", 0, 0.5),
        _ev(t + 2, "release", a, f"{a}/0/r0/rollout_prefill/0", 0),
        _ev(t + 2, "grant", a, f"{a}/0/r0/training/0", 0, 0.5),
        _ev(t + 4, "release", a, f"{a}/0/r0/training/0", 0),
        _ev(t + 4, "release", B, f"{B}/0/r0/training/0", 0),
    ])


def _bands(fig) -> dict[str, object]:
    """gid "pipeline|kind" -> the artist drawing it."""
    return {a.get_gid(): a for a in fig.findobj() if isinstance(a.get_gid(), str) and "|" in a.get_gid()}


def _texts(fig) -> str:
    from matplotlib.text import Text

    fig.canvas.draw()  # tick labels exist once drawn
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def test_bar_colour_follows_the_kind_and_the_hatch_the_pipeline():
    import matplotlib.pyplot as plt

    tl = tlm.build(_two_kinds_trace())
    assert tl.series[0].kind_share_frac[A, "training"] == pytest.approx((0.0, 0.5, 0.0))
    fig = tlm.figure(tl)
    try:
        bands = _bands(fig)
        assert set(bands) == {f"{A}|rollout_prefill", f"{A}|training", f"{B}|training"}
        color = {gid: tuple(b.get_facecolor()[0]) for gid, b in bands.items()}
        assert color[f"{A}|training"] == color[f"{B}|training"]  # one kind, two pipelines: one colour
        assert color[f"{A}|rollout_prefill"] != color[f"{A}|training"]  # one pipeline, two kinds: two colours
        assert bands[f"{A}|training"].get_hatch() != bands[f"{B}|training"].get_hatch()  # the pipeline channel
        kinds, pipes = ([t.get_text() for t in legend.get_texts()] for legend in fig.legends)
        assert {"rollout_prefill", "training"} <= set(kinds) and {A, B} <= set(pipes)
    finally:
        plt.close(fig)


def _cpu_trace(signal: str) -> Trace:
    """_two_kinds_trace as a CPU daemon writes it, marked as CPU by one `signal` only."""
    trace = _two_kinds_trace(first_grant_s=5.0)
    node = TraceEvent(t_s=0.0, event="node", pipeline="", data={"partitioner": "cpu" if signal == "node" else "sm"})
    events = [node]
    for e in trace.events:
        if e.event == "pipeline" and signal == "sku":
            e = TraceEvent(t_s=e.t_s, event="pipeline", pipeline=e.pipeline,
                           data={**e.data, "device": "CPU-x86_64-2c", "peak_flops": 1e11})
        if e.event == "grant" and signal == "partition":
            e = TraceEvent(t_s=e.t_s, event="grant", pipeline=e.pipeline, substage=e.substage, device=e.device,
                           sm_frac=e.sm_frac, data={"partition": {"kind": "cpu", "cores": [0, 1], "threads": 2}})
        events.append(e)
    return Trace(events)


@pytest.mark.parametrize("signal", ["node", "partition", "sku"])
def test_a_cpu_trace_says_cpu_and_cores_never_gpu_or_sm(signal):
    import matplotlib.pyplot as plt

    tl = tlm.build(_cpu_trace(signal))
    assert tl.hardware.device == "CPU" and tl.hardware.share == "core share"
    fig = tlm.figure(tl)
    try:
        drawn = _texts(fig)
    finally:
        plt.close(fig)
    page = re.sub(r"base64,[A-Za-z0-9+/=]+", "", tlm.html_page(tl))
    names = [e["args"]["name"] for e in tlm.chrome_trace(tl)["traceEvents"] if e["name"] == "process_name"]
    counters = {e["name"] for e in tlm.chrome_trace(tl)["traceEvents"] if e["ph"] == "C"}
    for text in (drawn, page, tlm.describe(tl), " ".join(names + sorted(counters))):
        assert "CPU" in text and "core share" in text, text
        assert not re.search(r"GPU|\bSM\b", text), text
    assert "CPU 0" in drawn and "CPU 0" in names and "1 CPU" in tlm.describe(tl)
    if signal != "node":  # the sku or the partitions count the cores
        assert "1 CPU (2 cores)" in tlm.describe(tl) and "(2 cores)" in drawn


def test_a_gpu_trace_keeps_gpu_and_sm_share():
    import matplotlib.pyplot as plt

    tl = tlm.build(_two_kinds_trace())
    fig = tlm.figure(tl)
    try:
        drawn = _texts(fig)
    finally:
        plt.close(fig)
    assert "GPU 0" in drawn and "SM share" in drawn and "CPU" not in drawn
    assert tlm.describe(tl).startswith("1 GPU, ") and "SM share granted" in tlm.describe(tl)


def test_start_up_is_cropped_off_the_axis_and_its_length_stated():
    import matplotlib.pyplot as plt

    trace = _two_kinds_trace(first_grant_s=20.0)  # first event at 0 s, first grant at 20 s, end at 24 s
    tl = tlm.build(trace)
    assert tl.startup_s == 20.0 and tl.window_s == 4.0
    assert tl.mean_util_frac == pytest.approx(1.0)  # the start-up counts in no mean
    fig = tlm.figure(tl)
    try:
        x0, x1 = fig.axes[0].get_xlim()
        assert 20.0 - 0.1 * tl.window_s <= x0 < 20.0 and x1 == pytest.approx(24.0)
        assert f"start-up {x0:.1f} s not shown" in _texts(fig)
    finally:
        plt.close(fig)
    assert "20.0 s start-up" in tlm.describe(tl)
    at_zero = tlm.build(_two_kinds_trace())  # a simulator trace: it starts with a grant
    fig = tlm.figure(at_zero)
    try:
        assert fig.axes[0].get_xlim()[0] == 0.0 and "start-up" not in _texts(fig)
    finally:
        plt.close(fig)
    assert at_zero.cropped_s == 0.0 and "start-up" not in tlm.describe(at_zero)


def test_the_axis_and_the_means_end_with_the_last_sub_stage_not_with_the_trace():
    """A daemon trace goes on after the work while pipelines unregister: that tail is neither
    drawn (it took 15% of a demo's axis) nor counted in the means."""
    import matplotlib.pyplot as plt

    work = _two_kinds_trace(first_grant_s=20.0)  # work from 20 s to 24 s
    tail = Trace([*work.events, _ev(40.0, "drop", A, "", None, 0.0)])  # unregistered 16 s later
    tl = tlm.build(tail)
    assert tl.work_end_s == 24.0 and tl.window_s == 4.0 and tl.mean_util_frac == pytest.approx(1.0)
    fig = tlm.figure(tl)
    try:
        assert fig.axes[0].get_xlim()[1] == pytest.approx(24.0 + CROP_MARGIN_FRAC * 4.0)
    finally:
        plt.close(fig)


def _table(page: str, cls: str) -> str:
    m = re.search(rf"<table class={cls}>(.*?)</table>", page, re.S)
    assert m, f"no {cls} table"
    return m.group(1)


def test_html_has_tables_per_pipeline_and_kind_the_fell_open_and_escapes_the_trace():
    hostile = "<script>alert('$x$')"
    trace = _two_kinds_trace(a=hostile)
    trace.add(_ev(1.0, "host", B, f"{B}/0/r0/reward/0", end_s=1.5))
    trace.add(_ev(3.0, "step", hostile, latency_s=3.0, tokens=42, flops=2e12))
    trace.add(_ev(3.5, "open", B, "pb/0/r0/training/0</td><script>", reason="<img src=x onerror=alert(1)>",
                  kind="training", rank=0, step=0))
    page = tlm.html_page(tlm.build(trace))
    assert "<script" not in page and "<img src=x" not in page  # nothing from the trace is markup
    pipes = _table(page, "pipelines")
    assert "<tr><td>&lt;script&gt;alert(&#x27;$x$&#x27;)</td>" in pipes and f"<tr><td>{B}</td>" in pipes
    assert "rollout_prefill s</th>" in pipes and "training s</th>" in pipes and "reward s</th>" in pipes
    assert re.search(r"<td>42</td><td>1</td>", pipes)  # tokens, steps of the hostile pipeline
    kinds = _table(page, "kinds")
    for kind, share in [("rollout_prefill", "25.0%"), ("training", "75.0%")]:  # of 4 device-s, 1 and 3
        assert re.search(rf"{kind}</td><td>\d+</td><td>[\d.]+</td><td>{share}</td><td>1.00×</td><td>50.0%</td>", kinds)
    assert "reward</td>" not in kinds and "reward (host)</td>" in kinds
    fell = _table(page, "fell-open")
    assert f"<td>{B}</td>" in fell and "&lt;img src=x onerror=alert(1)&gt;" in fell
    assert "&lt;/td&gt;&lt;script&gt;" in fell and "No sub-stage fell open" not in page
    assert "No sub-stage fell open" in tlm.html_page(tlm.build(_two_kinds_trace()))


# ------------------------------------------------------------------ the latest daemon trace by default


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "rt"
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    monkeypatch.setenv("JIGSAW_RUNTIME_DIR", str(path))
    return path


def test_no_trace_draws_the_newest_daemon_trace(runtime_dir, tmp_path, capsys):
    from jigsaw.cli.timeline import Args, run

    traces = runtime_dir / "traces"
    traces.mkdir(mode=0o700)
    old, new = traces / "daemon-20250101-000000-1.jsonl", traces / "daemon-20240101-000000-2.jsonl"
    _two_kinds_trace(a="old-pipeline").write(old)
    _two_kinds_trace(a="new-pipeline").write(new)
    os.utime(old, (1_000_000, 1_000_000))  # the newest by time, not by name
    os.utime(new, (2_000_000, 2_000_000))
    out = tmp_path / "t.html"
    assert run(Args(out=out)) == 0
    assert f"using the latest daemon trace: {new}" in capsys.readouterr().out
    page = out.read_text()
    assert "new-pipeline" in page and "old-pipeline" not in page
    assert main(["timeline", "--out", str(tmp_path / "t.png")]) == 0  # TRACE may be left out on the command line


def test_no_trace_and_none_in_the_runtime_dir_is_a_clear_error(runtime_dir, tmp_path, capsys):
    from jigsaw.cli.timeline import Args, run

    with pytest.raises(ValueError, match="no daemon trace") as err:
        run(Args(out=tmp_path / "t.png"))
    assert str(runtime_dir / "traces") in str(err.value)
    assert all(how in str(err.value) for how in ("jigsaw sim --out", "jigsaw daemon --trace", "jigsaw run"))
    assert main(["timeline", "--out", str(tmp_path / "t.png")]) == 2
    assert "no daemon trace" in capsys.readouterr().err and not (tmp_path / "t.png").exists()
