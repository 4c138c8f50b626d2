"""`jigsaw.mux.model.validate` and `jigsaw profile --check`: each rule fires on the fault it names, at its
threshold, and not on the shipped grids (a real 2-core CPU measurement and the analytic priors)."""

import json

import pytest

from jigsaw.cli.main import main
from jigsaw.mux.model.slowdown import SlowdownGrid
from jigsaw.mux.model.validate import (
    FLAT_TOL,
    MONOTONE_TOL,
    NOISE_MEDIAN_MAX,
    NOISE_POINT_MAX,
    PAIR_EXCESS_MAX,
    check_grid,
    is_degenerate,
)
from jigsaw.profiles import SHIPPED_DIR

SHIPPED = sorted(str(p.relative_to(SHIPPED_DIR)).removesuffix(".json") for p in SHIPPED_DIR.glob("*/*.json"))


def shipped_doc(name: str) -> dict:
    return json.loads((SHIPPED_DIR / f"{name}.json").read_text())


def rules(doc: dict) -> dict[str, list]:
    found = {}
    for f in check_grid(SlowdownGrid.from_dict(doc)):
        found.setdefault(f.rule, []).append(f)
    return found


def degenerate_cpu_doc() -> dict:
    """The shipped CPU grid as a loaded machine measured it: every kind 1.00 on half the cores,
    partitioned pairs free (best packing 2.00), shared points of training at 3.88."""
    doc = shipped_doc("cpu/tiny-qwen3")
    for table in doc["alone"].values():
        table[0] = [1.0] * len(table[0])
    for a, row in doc["pairs"].items():
        for b, table in row.items():
            table[0] = [1.0] * len(table[0])
            if "training" in (a, b):
                table[-1] = [3.88] * len(table[-1])
    return doc


def write(tmp_path, doc: dict):
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("name", SHIPPED)
def test_no_shipped_grid_is_degenerate(name):
    findings = check_grid(SlowdownGrid.load(name))
    assert not is_degenerate(findings), [f.message for f in findings]
    if name.endswith(".prior"):  # analytic: monotone, noiseless, nothing to warn about
        assert findings == []


@pytest.mark.parametrize("name", ["cpu/tiny-qwen3", "h100/qwen3-4b"])
def test_check_passes_a_shipped_grid(name, capsys):
    assert main(["profile", "--check", name]) == 0
    out = capsys.readouterr().out
    assert "DEGENERATE" not in out and "is usable" in out
    assert "alone at σ=" in out and "packing" in out  # the spread is printed beside the verdict


def test_check_refuses_a_degenerate_grid_naming_the_problem(tmp_path, capsys):
    assert main(["profile", "--check", write(tmp_path, degenerate_cpu_doc())]) == 1
    out = capsys.readouterr().out
    assert "DEGENERATE (flat): every kind alone at σ=0.5 (memory 0.5) is within 3%" in out
    assert "did not see the partition" in out
    assert "DEGENERATE (free_pack): every pair of kinds packs at the theoretical 2.00" in out
    assert "is degenerate" in out and "is usable" not in out


def test_check_of_a_missing_grid_is_a_usage_error(capsys):
    assert main(["profile", "--check", "cpu/no-such-model"]) == 2
    assert "no slowdown grid 'cpu/no-such-model'" in capsys.readouterr().err


def test_flat_needs_every_kind_within_the_tolerance():
    doc = degenerate_cpu_doc()
    doc["alone"]["training"][0][-1] = 1.0 + FLAT_TOL * 0.9  # still flat: within the tolerance
    assert [f.severity for f in rules(doc)["flat"]] == ["degenerate"]
    doc["alone"]["training"][0][-1] = 1.0 + FLAT_TOL * 2  # one kind sees the partition
    assert "flat" not in rules(doc)


def test_a_non_monotone_alone_table_is_flagged_naming_the_kind(tmp_path, capsys):
    doc = shipped_doc("h100/qwen3-4b.prior")
    quarter, half = doc["alone"]["training"][0], doc["alone"]["training"][1]
    quarter[-1] = half[-1] * (1 - MONOTONE_TOL / 2)  # faster on fewer SMs, but within the noise
    assert rules(doc) == {}
    quarter[-1] = half[-1] * 0.8
    (finding,) = rules(doc)["monotone"]
    assert finding.severity == "warning"
    assert finding.message.startswith(f"training alone at σ=0.25 mem=0.8 is {quarter[-1]:.2f}, ")
    assert "1 point of training" in finding.message
    assert main(["profile", "--check", write(tmp_path, doc)]) == 0  # a warning, not degenerate
    assert "warning (monotone): training alone at σ=0.25" in capsys.readouterr().out


def test_repeat_spread_above_its_threshold_is_flagged():
    doc = shipped_doc("h100/qwen3-4b.prior")
    doc["source"]["noise"] = {"repeats": 3, "repeated_values": 12, "max_spread_frac": NOISE_POINT_MAX * 0.9,
                              "median_spread_frac": NOISE_MEDIAN_MAX * 0.9, "kept_below_1": 0,
                              "max_spread_frac_by_kind": {"training": NOISE_POINT_MAX * 0.9, "reference": 0.01}}
    assert rules(doc) == {}
    doc["source"]["noise"]["max_spread_frac_by_kind"]["training"] = 0.8
    (finding,) = rules(doc)["noise"]
    assert finding.severity == "warning" and finding.message.startswith("training: repeats of one value varied by 80%")
    doc["source"]["noise"]["median_spread_frac"] = 0.25
    assert any("repeats disagree by 25%" in f.message for f in rules(doc)["noise"])


def test_a_grid_without_per_kind_spread_is_judged_by_its_largest():
    doc = shipped_doc("h100/qwen3-4b.prior")
    doc["source"]["noise"] = {"repeats": 3, "repeated_values": 5, "max_spread_frac": 0.8,
                              "median_spread_frac": 0.02, "kept_below_1": 0}
    (finding,) = rules(doc)["noise"]
    assert "one repeated value varied by 80% of its median over 3 runs" in finding.message


def test_a_partitioned_pair_far_above_alone_is_degenerate():
    doc = shipped_doc("h100/qwen3-4b.prior")
    alone = doc["alone"]["training"][0][-1]
    doc["pairs"]["training"]["reference"][0][-1] = alone * PAIR_EXCESS_MAX * 0.9  # a costly but possible partner
    assert rules(doc) == {}
    doc["pairs"]["training"]["reference"][0][-1] = alone * 4
    (finding,) = rules(doc)["pair_excess"]
    assert finding.severity == "degenerate"
    assert finding.message.startswith(f"training beside reference at σ=0.25 mem=0.8 is {alone * 4:.2f}, 4.0x its")


def test_free_packing_is_degenerate_only_when_every_pair_gets_it():
    doc = shipped_doc("h100/qwen3-4b.prior")
    for a, row in doc["pairs"].items():
        for b, table in row.items():
            if (a, b) != ("training", "training"):
                table[:-1] = [[None if v is None else 1.0 for v in r] for r in table[:-1]]
    assert "free_pack" not in rules(doc)  # training beside training still pays for the split
    doc["pairs"]["training"]["training"][:-1] = [[1.0] * 4 for _ in range(3)]
    (finding,) = rules(doc)["free_pack"]
    assert finding.severity == "degenerate" and "2.00" in finding.message
