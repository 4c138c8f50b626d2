"""`jigsaw doctor` and the GPU-side pieces it checks: SM-id census, MPS, NVML telemetry.

CPU tests run everywhere: without CUDA every GPU check must say why it is unavailable, and
the MPS / NVML code runs against fakes that stand for absent hardware (FakeNvml, a fake
nvidia-cuda-mps-control script).  `gpu` tests need a CUDA device and are skipped otherwise.
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from waiting import HANG_S, wait_until

from jigsaw.cli import doctor
from jigsaw.cli.main import main
from jigsaw.mux import telemetry
from jigsaw.mux.partition import mps, smid
from jigsaw.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("python", "torch", "driver", "cuda", "gpus", "telemetry", "mps", "green", "nvcc", "smid", "confinement")
GPU_CHECKS = ("driver", "cuda", "gpus", "telemetry", "green", "smid", "confinement")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _nvml_present() -> bool:
    try:
        with telemetry.nvml():
            return True
    except telemetry.TelemetryError:
        return False


HAS_CUDA = _cuda_available()
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="asserts what doctor says on a machine without CUDA")


def _doctor(*args):
    return subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "doctor", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, check=False)


# ------------------------------------------------------------------ doctor on a CPU machine


@cpu_only
def test_doctor_prints_every_check_with_its_reason_and_exits_0(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:-1] if line.startswith("  ") and line.split()}
    assert set(CHECKS) <= set(lines), out
    for name in GPU_CHECKS:
        assert f"{name}" in lines and "unavailable: " in lines[name], lines[name]
        assert len(lines[name].split("unavailable: ", 1)[1]) > 20  # a reason, not just the word
    assert "CPU build" in lines["smid"] and "CPU build" in lines["torch"]
    assert "libnvidia-ml.so" in lines["telemetry"]
    assert "--strict would exit 1" in out.splitlines()[-1]


@cpu_only
def test_doctor_subprocess_exits_0_and_strict_exits_1():
    res = _doctor()
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    for name in CHECKS:
        assert f"  {name} " in res.stdout
    strict = _doctor("--strict")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "Traceback" not in strict.stderr


@cpu_only
def test_doctor_json_parses_with_every_check(capsys):
    assert main(["doctor", "--json", "--device", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"ok", "strict", "device", "missing", "checks"}
    assert report["ok"] is False and report["strict"] is False and report["device"] == 0
    assert report["missing"] == []  # the test install has the [gpu] extra: what fails here is the machine
    assert tuple(report["checks"]) == CHECKS
    for name, check in report["checks"].items():
        assert set(check) == {"status", "detail", "gpu", "items", "data"}, name
        assert check["status"] in doctor.STATUSES and check["detail"], name
    for name in GPU_CHECKS:
        assert report["checks"][name]["status"] == "unavailable" and report["checks"][name]["gpu"] is True
    assert report["checks"]["python"]["status"] == "ok"


@cpu_only
def test_doctor_two_process_check_says_why_it_is_unavailable_without_cuda(capsys):
    assert main(["doctor", "--two-process", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert tuple(report["checks"]) == (*CHECKS, "two-process")  # added last, only when asked for
    check = report["checks"]["two-process"]
    assert check["status"] == "unavailable" and check["gpu"] is True and "CPU build" in check["detail"]


@pytest.mark.parametrize("argv", [["doctor", "--device", "-1"], ["doctor", "--fracs", "1.5"]])
def test_doctor_rejects_bad_arguments_with_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "error:" in capsys.readouterr().err


def test_strict_verdict_needs_gpu_checks_ok_and_no_failure():
    def c(status, gpu):
        return doctor.Check(name="x", status=status, detail="d", gpu=gpu)

    assert doctor.passes([c("ok", True), c("unavailable", False), c("warn", False)])
    assert not doctor.passes([c("ok", True), c("unavailable", True)])
    assert not doctor.passes([c("ok", True), c("fail", False)])  # e.g. an MPS thread cap


def test_a_check_that_raises_is_reported_as_fail(monkeypatch, capsys):
    def broken():
        raise OSError("disk on fire")

    monkeypatch.setattr(doctor, "check_nvcc", broken)
    assert main(["doctor"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  nvcc"))
    assert "fail: OSError: disk on fire" in line


def test_importing_doctor_and_mux_modules_loads_no_torch_or_gpu_library():
    probe = ("import sys\nimport jigsaw.cli.doctor, jigsaw.mux.partition.smid, jigsaw.mux.partition.mps\n"
             "import jigsaw.mux.telemetry\n"
             "print('LOADED', *(m in sys.modules for m in ('torch', 'pynvml', 'cuda.bindings')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "LOADED False False False" in out.stdout


# ------------------------------------------------------------------ SM-id census


@cpu_only
def test_smid_without_cuda_raises_the_named_error():
    with pytest.raises(smid.SmIdError, match="CPU build|no CUDA device"):
        smid.sm_ids(8)
    with pytest.raises(smid.SmIdError, match="cannot run CUDA kernels|no CUDA device"):
        smid.load_op()


def test_kernel_source_ships_and_reads_smid_on_the_current_stream():
    src = smid.SOURCE.read_text()
    assert smid.SOURCE.is_file() and "%%smid" in src and "clock64()" in src
    assert "getCurrentCUDAStream" in src and "TORCH_LIBRARY(jigsaw_smid" in src


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JIGSAW_CACHE_DIR", str(tmp_path))
    assert smid.cache_dir() == tmp_path
    monkeypatch.delenv("JIGSAW_CACHE_DIR")
    assert smid.cache_dir() == Path.home() / ".cache" / "jigsaw"


class FakeStream:
    """Stands for a green-context torch.cuda.Stream on a machine with no GPU."""

    device = "cuda:0"

    def __init__(self, ids):
        self.ids = ids


class FakeGreenPartitions:
    """Stands for jigsaw.mux.partition.green.GreenPartitions on absent hardware: fixed SM ids per side."""

    fracs = (0.25, 0.5, 0.75)

    def __init__(self, sides):
        self.sides = sides  # frac -> ((num_sms, ids), (num_sms, ids))

    def pair(self, frac):
        return tuple(SimpleNamespace(frac=f, num_sms=n, stream=FakeStream(ids))
                     for f, (n, ids) in zip((frac, 1 - frac), self.sides[frac], strict=True))


def test_confinement_launches_both_sides_before_reading_and_judges_each_budget(monkeypatch):
    log = []

    class FakeLaunch:
        def __init__(self, stream):
            self.stream = stream

        def ids(self):
            log.append("read")
            return set(self.stream.ids)

    def fake_launch(num_blocks, spin_ns, stream):
        log.append(("launch", num_blocks))
        return FakeLaunch(stream)

    fake_torch = SimpleNamespace(cuda=SimpleNamespace(
        get_device_properties=lambda d: SimpleNamespace(multi_processor_count=16)))
    monkeypatch.setattr(smid, "require_cuda", lambda device=None: fake_torch)
    monkeypatch.setattr(smid, "launch", fake_launch)
    parts = FakeGreenPartitions({
        0.25: ((4, {0, 1, 2, 3}), (12, set(range(4, 16)))),       # confined, disjoint
        0.5: ((8, set(range(8))), (8, set(range(7, 15)))),      # counts fit, SM 7 shared
        0.75: ((12, set(range(13))), (4, {13, 14, 15})),        # 13 ids on 12 SMs
    })
    report = smid.confinement(parts)
    assert log[:4] == [("launch", 64), ("launch", 64), "read", "read"]  # 4 blocks/SM x 16 SMs, overlapped
    ok, shared, spilled = report.budgets
    assert ok.ok and not ok.overlap and "OK" in ok.describe()
    assert all(s.within for s in shared.sides) and shared.overlap == {7} and not shared.ok
    assert not spilled.overlap and not spilled.sides[0].within and not spilled.ok and "FAIL" in spilled.describe()
    assert not report.ok and report.device_sms == 16


def _runs(frac, num_sms, ids, alone_s, together):
    """What one census worker reports for a budget: runs are (start_s, end_s, gpu_s)."""
    return {"frac": frac, "num_sms": num_sms, "sm_ids": sorted(ids), "alone": [(0.0, alone_s, alone_s)],
            "together": [together]}


def test_two_process_judge_checks_ids_and_tells_concurrent_from_time_sliced():
    # side 0 alone 10 ms, side 1 alone 20 ms; together: 20 ms when they overlap, 30 ms one after the other
    concurrent = smid.judge_two_process(_runs(0.25, 4, range(4), 0.010, (100.0, 100.010, 0.010)),
                                        _runs(0.25, 12, range(4, 16), 0.020, (100.0, 100.020, 0.020)))
    assert concurrent.ok and concurrent.concurrent and concurrent.serial_frac == pytest.approx(0.0)
    assert concurrent.census.sides[1].frac == 0.75 and concurrent.together_s == pytest.approx(0.020)
    sliced = smid.judge_two_process(_runs(0.25, 4, range(4), 0.010, (100.0, 100.010, 0.010)),
                                    _runs(0.25, 12, range(3, 15), 0.020, (100.0, 100.030, 0.030)))
    assert not sliced.concurrent and sliced.serial_frac == pytest.approx(1.0)
    assert not sliced.ok and sliced.census.overlap == {3} and "one after the other" in sliced.describe()
    with pytest.raises(ValueError, match="different budgets"):
        smid.judge_two_process(_runs(0.25, 4, range(4), 0.01, (0, 1, 1)), _runs(0.5, 4, range(4), 0.01, (0, 1, 1)))


# ------------------------------------------------------------------ MPS


def test_mps_parses_captured_control_outputs():
    assert mps.parse_server_list("") == ()
    assert mps.parse_server_list("31245\n31302\n") == (31245, 31302)
    with pytest.raises(mps.MpsError, match="one PID per line"):
        mps.parse_server_list("Cannot find MPS control daemon process\n")
    assert mps.parse_thread_percentage("100.0\n") == 100.0
    assert mps.parse_thread_percentage("25\n") == 25.0
    assert mps.parse_thread_percentage("\n") is None
    for bad in ("abc\n", "150.0\n", "0\n"):
        with pytest.raises(mps.MpsError):
            mps.parse_thread_percentage(bad)
    assert mps.env_thread_percentage({}) is None
    assert mps.env_thread_percentage({mps.THREAD_PCT_ENV: "40"}) == 40.0


def test_mps_flags_a_thread_percentage_below_100():
    base = {"state": "running", "reason": "r", "pipe_dir": "/tmp/nvidia-mps"}
    assert not mps.MpsStatus(**base, default_thread_pct=100.0).thread_pct_capped
    capped = mps.MpsStatus(**base, default_thread_pct=50.0, server_thread_pct={7: 30.0})
    assert capped.thread_pct_capped
    notes = mps.cap_warnings(capped)
    assert len(notes) == 2 and "overriding green-context splits" in notes[0] and "server 7" in notes[1]


def test_mps_status_without_the_binary(tmp_path):
    s = mps.status({"PATH": str(tmp_path), "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe")})
    assert s.state == "no-binary" and "nvidia-cuda-mps-control not on PATH" in s.reason
    assert mps.ensure_mps(True, env={"PATH": str(tmp_path)}).state == "no-binary"  # nothing to start


FAKE_CONTROL = """#!/bin/sh
# Fake nvidia-cuda-mps-control: stands for the NVIDIA binary on a machine without a driver.
if [ "$1" = "-d" ]; then
    echo "pct=[$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE]" > "$FAKE_MPS_STATE/daemon_env"
    touch "$FAKE_MPS_STATE/running"
    exit 0
fi
if [ ! -f "$FAKE_MPS_STATE/running" ]; then
    echo "Cannot find MPS control daemon process"
    exit 1
fi
read cmd arg
case "$cmd" in
    get_server_list) echo 4242 ;;
    get_default_active_thread_percentage) cat "$FAKE_MPS_STATE/default_pct" ;;
    get_active_thread_percentage) echo 100.0 ;;
    quit) [ -f "$FAKE_MPS_STATE/deaf" ] || rm "$FAKE_MPS_STATE/running" ;;
    *) echo "unknown command $cmd"; exit 1 ;;
esac
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """A fake control binary on PATH and a device node that 'exists' (absent hardware stand-ins)."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    (state / "default_pct").write_text("100.0\n")
    control = bin_dir / mps.CONTROL_BIN
    control.write_text(FAKE_CONTROL)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(mps, "gpu_present", lambda: True)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_MPS_STATE": str(state),
           "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe")}
    return SimpleNamespace(env=env, state=state)


def test_mps_stopped_then_started_without_a_thread_percentage(fake_mps):
    stopped = mps.status(fake_mps.env)
    assert stopped.state == "stopped" and any("time-sliced" in w for w in stopped.warnings)
    assert mps.ensure_mps(False, env=fake_mps.env).state == "stopped"  # only reports
    env = {**fake_mps.env, mps.THREAD_PCT_ENV: "50"}
    started = mps.ensure_mps(True, env=env)
    assert started.state == "running" and started.started and started.server_pids == (4242,)
    assert (fake_mps.state / "daemon_env").read_text().strip() == "pct=[]"  # removed from the daemon's env
    assert started.env_thread_pct == 50.0 and started.thread_pct_capped  # ...and still flagged for us
    assert any(mps.THREAD_PCT_ENV in w for w in started.warnings)


def test_mps_started_here_is_stopped_and_a_daemon_that_stays_is_said_so(fake_mps):
    assert mps.ensure_mps(True, env=fake_mps.env).running
    assert mps.stop_mps(env=fake_mps.env, timeout_s=2.0) == "stopped"
    assert mps.status(fake_mps.env).state == "stopped"
    assert mps.stop_mps(env=fake_mps.env, timeout_s=2.0) == "stopped"  # none running: nothing to do
    (fake_mps.state / "running").touch()
    (fake_mps.state / "deaf").touch()  # answers `quit` and keeps running
    assert mps.stop_mps(env=fake_mps.env, timeout_s=0.5) == "still running 0.5s after quit"


def test_mps_running_with_a_default_percentage_fails_the_doctor_check(fake_mps, monkeypatch):
    (fake_mps.state / "running").touch()
    (fake_mps.state / "default_pct").write_text("25.0\n")
    s = mps.status(fake_mps.env)
    assert s.running and s.default_thread_pct == 25.0 and s.thread_pct_capped
    for key, value in fake_mps.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(mps.THREAD_PCT_ENV, raising=False)
    check = doctor.check_mps(start=False)
    assert check.status == "fail" and "25" in check.items[0]
    (fake_mps.state / "default_pct").write_text("100.0\n")
    assert doctor.check_mps(start=False).status == "ok"


# ------------------------------------------------------------------ telemetry


@pytest.mark.skipif(_nvml_present(), reason="NVML is present on this machine")
def test_telemetry_without_nvml_raises_the_clear_error():
    with pytest.raises(telemetry.TelemetryError, match="libnvidia-ml.so"):
        telemetry.sample()
    with pytest.raises(telemetry.TelemetryError, match="no NVIDIA driver"):
        telemetry.Telemetry(Trace()).start()


class FakeNvml:
    """Stands for NVML on a machine without a GPU: two devices, canned readings."""

    def __init__(self, pynvml, fail_after=None):
        self.pynvml, self.inits, self.samples, self.fail_after = pynvml, 0, 0, fail_after

    def install(self, monkeypatch):
        for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                     "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
                     "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses",
                     "nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetName",
                     "nvmlDeviceGetCudaComputeCapability"):
            monkeypatch.setattr(self.pynvml, name, getattr(self, name))

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetUtilizationRates(self, h):
        self.samples += 1
        if self.fail_after is not None and self.samples > self.fail_after:
            raise self.pynvml.NVMLError_GpuIsLost()
        return SimpleNamespace(gpu=37 + h[1], memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=(h[1] + 1) * 2**30, total=80 * 2**30, free=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=100 + h[1], usedGpuMemory=2**30)]

    def nvmlSystemGetDriverVersion(self):
        return "580.105.08"

    def nvmlSystemGetCudaDriverVersion(self):
        return 13000

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"  # older pynvml returns bytes

    def nvmlDeviceGetCudaComputeCapability(self, h):
        if h[1] == 1:
            raise self.pynvml.NVMLError_NotSupported()
        return (9, 0)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h):
        if h[1] == 1:
            raise self.pynvml.NVMLError_NotSupported()
        return [SimpleNamespace(pid=200, usedGpuMemory=None)]


@pytest.fixture
def fake_nvml(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml(pynvml)
    fake.install(monkeypatch)
    return fake


def test_telemetry_appends_trace_events_with_the_documented_fields(fake_nvml, tmp_path):
    trace = Trace()
    with telemetry.Telemetry(trace, interval_s=0.01) as tel:
        wait_until(lambda: len(trace.events) >= 6, HANG_S, "six telemetry samples")
        assert tel.devices == [0, 1]
    assert fake_nvml.inits == 0  # every nvmlInit was shut down
    events = list(trace.events)
    assert len(events) >= 6 and {e.device for e in events} == {0, 1}
    assert all(e.event == "telemetry" and e.pipeline == "" for e in events)
    d0 = next(e for e in events if e.device == 0)
    assert d0.data == {"sm_util_frac": 0.37, "mem_used_bytes": 2**30, "mem_total_bytes": 80 * 2**30,
                       "processes": {"100": 2**30, "200": None}}
    d1 = next(e for e in events if e.device == 1)
    assert d1.data["processes"] == {"101": 2**30}  # no MPS listing on this device
    times = [e.t_s for e in events]
    assert times == sorted(times) and times[0] >= 0
    path = tmp_path / "t.jsonl"
    trace.write(path)
    assert Trace.read(path).events == events  # str pid keys survive JSON


def test_telemetry_feeds_a_callback_and_maps_cuda_visible_devices(fake_nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    got = []
    tel = telemetry.Telemetry(got.append, clock=lambda: 42.0, interval_s=60)
    tel.start()
    try:
        tel.sample_once()
    finally:
        tel.stop()
    assert tel.devices == [0]  # one visible device...
    assert {e.device for e in got} == {0} and got[0].t_s == 42.0
    assert got[0].data["sm_util_frac"] == 0.38  # ...which is physical GPU 1
    (s,) = telemetry.sample([0])
    assert s.processes == {"101": 2**30}


def test_telemetry_thread_error_is_raised_by_stop(fake_nvml):
    fake_nvml.fail_after = 3
    tel = telemetry.Telemetry(Trace(), interval_s=0.01).start()
    wait_until(lambda: tel.error is not None, HANG_S, "the sampling thread's error")
    with pytest.raises(telemetry.TelemetryError, match="sampling failed"):
        tel.stop()
    assert fake_nvml.inits == 0


def test_doctor_telemetry_check_reads_the_fake_nvml(fake_nvml):
    check = doctor.check_telemetry(0)
    assert check.status == "ok" and "37%" in check.detail and check.data["processes"] == {"100": 2**30, "200": None}


def test_nvml_info_feeds_the_driver_and_gpu_checks(fake_nvml):
    nv = telemetry.info()
    assert nv.driver_version == "580.105.08" and nv.cuda_driver_version == 13000
    assert [(d.name, d.compute_capability) for d in nv.devices] == [("NVIDIA H100 80GB HBM3", (9, 0)),
                                                                    ("NVIDIA H100 80GB HBM3", None)]
    driver = doctor.check_driver()
    assert driver.status == "ok" and "580.105.08" in driver.detail and "13.0" in driver.detail
    if not HAS_CUDA:  # torch cannot use the GPUs NVML lists: say so, and list them
        gpus = doctor.check_gpus()
        assert gpus.status == "unavailable" and "cannot use the 2 GPU(s)" in gpus.detail
        assert gpus.items[0] == "gpu 0: NVIDIA H100 80GB HBM3, cc 9.0, SMs unknown, 80.0 GiB"
        assert "cc ?" in gpus.items[1]


# ------------------------------------------------------------------ on a GPU


def _num_sms(device=0):
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


@pytest.mark.gpu
def test_smid_kernel_builds_and_reports_ids_within_the_device():
    import torch

    num_sms = _num_sms()
    ids = smid.sm_ids(smid.BLOCKS_PER_SM * num_sms)
    assert ids and all(0 <= i < num_sms for i in ids)
    assert len(ids) >= num_sms // 2  # the census spreads, or confinement could not be seen
    side = torch.cuda.Stream()
    assert smid.sm_ids(64, stream=side)  # runs on the stream it is given


@pytest.mark.gpu
def test_confinement_holds_for_every_budget():
    green = pytest.importorskip("jigsaw.mux.partition.green")
    green_probe = pytest.importorskip("jigsaw.mux.partition.green_probe")
    try:
        green_probe.probe(0)
    except green_probe.GreenContextError as exc:
        pytest.skip(f"no green contexts here: {exc}")
    with green.GreenPartitions(device=0, fracs=(0.25, 0.5, 0.75)) as parts:
        report = smid.confinement(parts, (0.25, 0.5, 0.75))
    assert report.ok, [b.describe() for b in report.budgets]


@pytest.mark.gpu
def test_two_process_census_keeps_each_process_on_its_side():
    green_probe = pytest.importorskip("jigsaw.mux.partition.green_probe")
    try:
        green_probe.probe(0)
    except green_probe.GreenContextError as exc:
        pytest.skip(f"no green contexts here: {exc}")
    report = smid.two_process_census((0.25, 0.5), 0, repeats=1)
    assert report.ok, [b.describe() for b in report.budgets]


@pytest.mark.gpu
def test_telemetry_samples_a_real_device():
    import torch

    x = torch.ones(1 << 20, device="cuda")  # noqa: F841  (a context and some memory in use)
    (s,) = telemetry.sample([0])
    assert 0.0 <= s.sm_util_frac <= 1.0 and 0 < s.mem_used_bytes <= s.mem_total_bytes
    trace = Trace()
    with telemetry.Telemetry(trace, devices=[0], interval_s=0.05):
        wait_until(lambda: len(trace.events) >= 2, HANG_S, "two telemetry samples of the GPU")
    assert trace.events and all(e.event == "telemetry" and e.device == 0 for e in trace.events)


@pytest.mark.gpu
def test_doctor_strict_passes_on_a_gpu_machine():
    res = _doctor("--strict")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "confinement  ok:" in res.stdout
