"""`jigsaw profile`: grid assembly from measurements, kernels from a model config, where the CLI
writes (never over a shipped grid unless asked; a degenerate grid beside it), CLI errors."""

import functools
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from jigsaw.cli.main import main
from jigsaw.mux.model.slowdown import DeviceInfo, load_grid
from jigsaw.mux.model.specs import H100, ModelSpec, PriorConfig
from jigsaw.mux.profiling.kernels import KINDS, build_kernels, model_spec
from jigsaw.mux.profiling.profiler import MeasurementError, ProfileConfig, measure_grid
from jigsaw.profiles import SHIPPED_DIR, resolve, user_dir

ROOT = Path(__file__).resolve().parents[2]


class FakeBench:
    """Stands for a GPU, which this machine lacks: time per token = base / σ^α per kind, and a
    fixed interference factor when two kinds share the device (more when unpartitioned)."""

    device_info = H100
    mem_levels = (0.2, 0.4, 0.6, 0.8)
    BASE = {"rollout_prefill": 1.0, "rollout_decode": 2.0, "rollout_tail": 4.0, "reference": 1.5, "training": 3.0}
    ALPHA = {"rollout_prefill": 0.9, "rollout_decode": 0.3, "rollout_tail": 0.1, "reference": 0.9, "training": 0.95}

    def __init__(self):
        self.calls = 0

    def t(self, kind, sm_frac, mem_frac):
        return self.BASE[kind] / sm_frac ** self.ALPHA[kind] * (1 + 0.1 * (0.8 - mem_frac))

    def alone(self, kind, sm_frac, mem_frac):
        self.calls += 1
        return self.t(kind, sm_frac, mem_frac)

    def pair(self, a, b, sm_frac_a, mem_frac_a):
        self.calls += 1
        if sm_frac_a >= 1.0:  # shared SMs: both slow down by their partner's appetite
            return (self.BASE[a] * (1 + self.ALPHA[b]), self.BASE[b] * (1 + self.ALPHA[a]))
        return (self.t(a, sm_frac_a, mem_frac_a) * 1.05, self.t(b, 1 - sm_frac_a, 1 - mem_frac_a) * 1.05)


@pytest.mark.timeout(60)
def test_measured_grid_is_valid_and_both_views_come_from_one_run(tmp_path):
    bench = FakeBench()
    lines = []
    grid = measure_grid(bench, "qwen3-0.6b", progress=lines.append)
    assert grid.source["kind"] == "measured"
    assert grid.alone("training", 1.0, 0.8) == 1.0
    assert grid.alone("training", 0.25, 0.8) == pytest.approx(0.25 ** -0.95, rel=1e-3)
    sa, sb = grid.pair("rollout_tail", "training", 0.25, 0.2)
    assert sa == pytest.approx(bench.t("rollout_tail", 0.25, 0.2) * 1.05 / bench.t("rollout_tail", 1, 0.8), rel=1e-3)
    assert sb == pytest.approx(bench.t("training", 0.75, 0.8) * 1.05 / bench.t("training", 1, 0.8), rel=1e-3)
    assert grid.slowdown("training", "rollout_tail", 1.0, 0.4) == pytest.approx(1 + 0.1, rel=1e-3)  # shared row
    n_pairs = 15 * 16  # unordered kind pairs (with self pairs) × σ levels × memory levels
    assert len(lines) == n_pairs and lines[-1].startswith(f"[{n_pairs}/{n_pairs}]")
    # base times are medians of 3 runs, the normalisation point is not measured again, and a
    # bench without noise never makes a point repeat
    assert bench.calls == 5 * 3 + 5 * 16 - 5 + n_pairs
    assert grid.source["noise"] == {"repeats": 3, "repeated_values": 5, "max_spread_frac": 0.0,
                                    "median_spread_frac": 0.0, "kept_below_1": 0,
                                    "max_spread_frac_by_kind": dict.fromkeys(FakeBench.BASE, 0.0)}
    out = tmp_path / "g.json"
    grid.save(out)
    assert load_grid(out) == grid


class NoisyBench(FakeBench):
    """FakeBench whose pairs of rollout_tail with training come out 20% fast on their first run
    (noise, as on a loaded machine), and whose shared self-pair of decode is always 3% fast."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def pair(self, a, b, sm_frac_a, mem_frac_a):
        t_a, t_b = super().pair(a, b, sm_frac_a, mem_frac_a)
        if (a, b) == ("rollout_tail", "training") and (key := (sm_frac_a, mem_frac_a)) not in self.seen:
            self.seen.add(key)
            return 0.8 * self.BASE[a], t_b
        if (a, b, sm_frac_a) == ("rollout_decode", "rollout_decode", 1.0):
            return 0.97 * self.BASE[a], 0.97 * self.BASE[b]
        return t_a, t_b


@pytest.mark.timeout(60)
def test_noisy_points_are_measured_again_and_kept_unclamped_with_their_spread():
    bench = NoisyBench()
    grid = measure_grid(bench, "qwen3-0.6b", repeats=3)
    clean = measure_grid(FakeBench(), "qwen3-0.6b", repeats=3)
    # first run 0.8 of alone, then twice the true value: the median of the three is the true value
    assert grid.pair("rollout_tail", "training", 0.25, 0.2) == clean.pair("rollout_tail", "training", 0.25, 0.2)
    # consistently faster than alone: kept as measured (0.97), not clamped to a "perfect" 1.0
    assert grid.pair("rollout_decode", "rollout_decode", 1.0, 0.4) == (0.97, 0.97)
    noise = grid.source["noise"]
    assert noise["kept_below_1"] == 4 * 2  # the decode self-pair at 4 memory levels, both views
    assert noise["max_spread_frac"] > 0.0 and noise["repeated_values"] > 5
    # the spread is the noisy kind's: the first run of rollout_tail beside training was 20% fast
    by_kind = noise["max_spread_frac_by_kind"]
    assert by_kind.pop("rollout_tail") == noise["max_spread_frac"] and set(by_kind.values()) == {0.0}
    # a noisy point: 3 runs in all, the 2 repeats each after a fresh measurement of both bases
    assert bench.calls == 5 * 3 + 5 * 16 - 5 + 240 + (16 + 4) * 2 * 3


class SpikedBench(FakeBench):
    """FakeBench whose machine was busy while rollout_tail's base was measured: its first three
    whole-device runs (the base's) take 8x as long, every later run is as usual."""

    def __init__(self):
        super().__init__()
        self.spiked = 0

    def alone(self, kind, sm_frac, mem_frac):
        t = super().alone(kind, sm_frac, mem_frac)
        if kind == "rollout_tail" and sm_frac == 1.0 and self.spiked < 3:
            self.spiked += 1
            return 8 * t
        return t


@pytest.mark.timeout(60)
def test_a_point_still_under_the_noise_floor_is_refused_by_name():
    class Busy(FakeBench):  # both cores shared with other jobs: one core alone is 10x faster
        def alone(self, kind, sm_frac, mem_frac):
            t = super().alone(kind, sm_frac, mem_frac)
            return 0.1 * t if kind == "training" and sm_frac < 1.0 else t

    with pytest.raises(MeasurementError, match=r"training alone at σ=0.25 mem=0.2: 0.\d+ .* 3 paired runs"):
        measure_grid(Busy(), "qwen3-0.6b", repeats=3)


@pytest.mark.timeout(60)
def test_a_base_measured_under_a_load_spike_does_not_make_its_kind_look_faster():
    # Against the inflated base every point of the kind comes out at 1/8 (under the noise
    # floor: the grid would not even load); the paired repeats divide by a fresh base instead.
    grid = measure_grid(SpikedBench(), "qwen3-0.6b", repeats=3)
    clean = measure_grid(FakeBench(), "qwen3-0.6b", repeats=3)
    for s in (0.25, 0.5, 0.75):
        assert grid.alone("rollout_tail", s, 0.4) == pytest.approx(clean.alone("rollout_tail", s, 0.4))
        assert grid.pair("rollout_tail", "training", s, 0.4) == clean.pair("rollout_tail", "training", s, 0.4)


def test_asymmetric_memory_levels_are_refused():
    with pytest.raises(ValueError, match="symmetric"):
        measure_grid(FakeBench(), "m", mem_levels=(0.2, 0.5, 0.7))


TINY = ModelSpec(params=1e6, num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                 head_dim=8, vocab=100, tie_word_embeddings=True)
SHAPES = replace(PriorConfig(), prefill_tokens=64, decode_max_batch=16, decode_context_tokens=32, tail_batch=2,
                 tail_context_tokens=48, train_micro_batch_tokens=128, train_min_micro_batch_tokens=32,
                 train_seq_tokens=32, ref_micro_batch_tokens=256)


def test_kernels_run_and_memory_buys_batch():
    top = build_kernels(TINY, SHAPES, 0.8, top_mem_frac=0.8, layers=1, device="cpu")
    low = build_kernels(TINY, SHAPES, 0.2, top_mem_frac=0.8, layers=1, device="cpu")
    for k in KINDS:
        top[k].step()
        low[k].step()
    assert {k: top[k].tokens for k in KINDS} == {"rollout_prefill": 64, "rollout_decode": 16, "rollout_tail": 2,
                                                  "reference": 256, "training": 128}
    assert (low["rollout_decode"].tokens, low["training"].tokens, low["reference"].tokens) == (4, 32, 64)
    assert low["rollout_tail"].tokens == 2 and low["rollout_prefill"].tokens == 64


def test_model_from_an_hf_config(tmp_path):
    cfg = {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 1000}
    path = tmp_path / "mymodel" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    name, spec = model_spec(str(path))
    assert name == "mymodel" and spec.head_dim == 16 and spec.num_kv_heads == 2
    with pytest.raises(ValueError, match="unknown model"):
        model_spec("no-such-model")
    path.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks"):
        model_spec(str(path))


def test_datasheet_peaks_come_from_the_prior_devices():
    from jigsaw.mux.model.specs import A100
    from jigsaw.mux.profiling.cuda_bench import datasheet_peaks

    assert datasheet_peaks("NVIDIA H100 80GB HBM3") == (H100.peak_flops, H100.mem_bw_bytes_per_s)
    assert datasheet_peaks("NVIDIA A100-SXM4-80GB") == (A100.peak_flops, A100.mem_bw_bytes_per_s)
    assert datasheet_peaks("NVIDIA H200") == (989e12, 4.8e12)
    assert datasheet_peaks("Tesla T4") == (1.0, 1.0)


@pytest.mark.timeout(300)
def test_profile_without_a_gpu_says_why():
    r = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "profile", "--model", "qwen3-0.6b"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "cannot profile on CUDA" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "profile", "--device", "tpu"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "use cuda or cpu" in r.stderr


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_profile_smoke_on_a_gpu(tmp_path):
    from jigsaw.mux.profiling.cuda_bench import CudaBench

    bench = CudaBench(ProfileConfig(model="qwen3-0.6b", layers=1, min_time_s=0.05,
                                    shapes=replace(PriorConfig(), decode_max_batch=64, prefill_tokens=1024)))
    try:
        grid = measure_grid(bench, "qwen3-0.6b", kinds=("rollout_decode", "training"))
    finally:
        bench.close()
    assert grid.alone("training", 0.25, 0.8) > 1.2  # a quarter of the SMs slows a compute-bound kind
    grid.save(tmp_path / "g.json")
    assert load_grid(tmp_path / "g.json") == grid


@pytest.mark.timeout(300)
def test_cpu_profile_measures_a_valid_grid_on_this_machine(tmp_path):
    """Real measurement (short): the recipe's model on core sets; the grid loads and holds
    what was measured, or, on a machine too busy to measure, the profiler says which point."""
    from jigsaw.cli.profile import cpu_model
    from jigsaw.mux.partition.cpu import cpu_levels
    from jigsaw.mux.profiling.cpu_bench import CpuBench

    bench = CpuBench(functools.partial(cpu_model, "tiny-qwen3"), min_time_s=0.05)
    grid = refused = None
    try:
        levels = cpu_levels(len(bench.cores))
        grid = measure_grid(bench, "tiny-qwen3", sm_levels=levels, mem_levels=(0.2, 0.8),
                            kinds=("rollout_tail", "training"))
    except MeasurementError as exc:
        refused = str(exc)
    finally:
        bench.close()
    assert not any(p.is_alive() for p in bench.procs)
    if refused is not None:
        # Shared with other jobs, a one-core split can run many times faster than both cores
        # (their threads wait for each other): that is a measurement of the load, refused by name.
        assert "paired runs, below the noise floor" in refused and "σ=" in refused
        return
    assert grid.device.sku.startswith("CPU-") and grid.device.num_sms == len(bench.cores)
    assert grid.device.peak_flops > 1e8  # measured matmul throughput
    # What was measured is what the grid holds, however loaded this machine is (how much half
    # the cores slow training is a measurement, not a property to test: see the CPU profile)
    noise = grid.source["noise"]
    assert noise["repeats"] == 3 and noise["repeated_values"] >= 2  # base times: medians of 3
    values = [v for k in grid.kinds for row in grid.to_dict()["alone"][k] for v in row]
    assert all(math.isfinite(v) and v > 0 for v in values)
    grid.save(tmp_path / "cpu.json")
    assert load_grid(tmp_path / "cpu.json") == grid
    assert not any(p.is_alive() for p in bench.procs)


# ---------------------------------------------------------------- where `jigsaw profile` writes

CPU_2C = DeviceInfo(sku="CPU-x86_64-2c", num_sms=2, mem_bytes=2**34, peak_flops=1e11, mem_bw_bytes_per_s=1.0)


class CpuFakeBench(FakeBench):
    """FakeBench as `jigsaw profile --device cpu` sees it on 2 cores: default output cpu/tiny-qwen3."""

    device_info = CPU_2C

    def close(self):
        pass


class FlatBench(CpuFakeBench):
    """A loaded machine: half the cores are as fast as both, and a partner on the other half costs
    nothing (the degenerate grid a user once got)."""

    def t(self, kind, sm_frac, mem_frac):
        return super().t(kind, 1.0, mem_frac)


@pytest.fixture
def fake_cli(monkeypatch, tmp_path):
    """`jigsaw profile --device cpu` on a fake bench, with a copy of the shipped grids standing for
    the installed ones (a broken refusal overwrites the copy, never the checkout's files)."""
    shipped = tmp_path / "installed"
    shutil.copytree(SHIPPED_DIR, shipped)
    monkeypatch.setattr("jigsaw.profiles.SHIPPED_DIR", shipped)
    benches = []

    def profile(*flags, bench=CpuFakeBench):
        benches.append(bench())
        monkeypatch.setattr("jigsaw.cli.profile._bench", lambda cfg: (benches[-1], "tiny-qwen3", (0.5, 1.0), "fake"))
        return main(["profile", "--device", "cpu", *flags])

    profile.shipped = shipped / "cpu" / "tiny-qwen3.json"
    profile.benches = benches
    return profile


@pytest.mark.timeout(60)
def test_the_default_output_is_the_user_profile_dir_and_the_name_finds_it(fake_cli, capsys):
    real = (SHIPPED_DIR / "cpu" / "tiny-qwen3.json").read_bytes()
    assert fake_cli() == 0
    out = user_dir() / "cpu" / "tiny-qwen3.json"  # JIGSAW_PROFILE_DIR: a tmp dir per test (conftest)
    assert load_grid(out).source["note"] == "fake" and resolve("cpu/tiny-qwen3") == out
    err = capsys.readouterr().err
    assert f"wrote {out}; the name cpu/tiny-qwen3 now resolves to it (it shadows the shipped {fake_cli.shipped})" in err
    assert "[120/120] training + training at σ=1 mem=0.8" in err  # progress lines are kept
    assert (SHIPPED_DIR / "cpu" / "tiny-qwen3.json").read_bytes() == real


@pytest.mark.timeout(60)
def test_a_shipped_grid_is_overwritten_only_when_out_names_it(fake_cli, monkeypatch, capsys):
    before = fake_cli.shipped.read_bytes()
    listed = sorted(p.name for p in fake_cli.shipped.parent.iterdir())
    monkeypatch.setenv("JIGSAW_PROFILE_DIR", str(fake_cli.shipped.parents[1]))  # user dir = the installed grids
    assert fake_cli() == 2
    assert f"jigsaw: error: refusing to write {fake_cli.shipped}: it is inside the grids installed" in \
        capsys.readouterr().err
    assert fake_cli.benches[-1].calls == 0  # refused before measuring
    assert fake_cli.shipped.read_bytes() == before
    assert sorted(p.name for p in fake_cli.shipped.parent.iterdir()) == listed  # nothing written beside it
    assert fake_cli("--out", str(fake_cli.shipped)) == 0  # asked for by name: written
    assert load_grid(fake_cli.shipped).source["note"] == "fake"
    assert "over the shipped grid (asked with --out)" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_degenerate_measurement_is_kept_beside_the_output_where_the_name_does_not_find_it(fake_cli, capsys):
    assert fake_cli(bench=FlatBench) == 1
    out = user_dir() / "cpu" / "tiny-qwen3.json"
    rejected = out.with_name("tiny-qwen3.rejected.json")
    assert not out.exists() and load_grid(rejected).source["note"] == "fake"
    assert resolve("cpu/tiny-qwen3") == fake_cli.shipped  # the name still means the shipped grid
    err = capsys.readouterr().err
    assert "DEGENERATE (flat): every kind alone at σ=0.5 (memory 0.8) is within 3%" in err
    assert f"NOT written to {out}" in err and f"It is at {rejected} for inspection" in err
    assert f"the name cpu/tiny-qwen3 still resolves to {fake_cli.shipped}" in err


def test_a_one_core_device_is_profiled_by_time_sharing_its_core(monkeypatch):
    """A device per core: half of it is the core shared with a busy spinner, a pair is both
    processes on the core (no split of one core is asked for)."""
    from jigsaw.mux.profiling.cpu_bench import SPIN, CpuBench

    core = sorted(os.sched_getaffinity(0))[0]
    bench = CpuBench.__new__(CpuBench)  # the dispatch only: no worker processes
    bench.cores, ran = (core,), []
    monkeypatch.setattr(bench, "_run", lambda jobs: ran.append(jobs) or [1.0] * len(jobs))
    bench.alone("training", 1.0, 0.5)
    bench.alone("training", 0.5, 0.5)
    bench.pair("rollout_tail", "training", 0.5, 0.5)
    assert ran == [[(0, "training", 0.5, (core,))],
                   [(0, "training", 0.5, (core,)), (1, SPIN, 0.0, (core,))],
                   [(0, "rollout_tail", 0.5, (core,)), (1, "training", 0.5, (core,))]]
