"""Slowdown grid: file format v1, validation, interpolation (jigsaw.mux.model.slowdown)."""

from __future__ import annotations

import copy
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jigsaw.mux.model.slowdown import (
    DEFAULT_MEM_LEVELS,
    DEFAULT_SM_LEVELS,
    SlowdownFileError,
    SlowdownGrid,
    load_grid,
)
from jigsaw.profiles import SHIPPED_DIR

PROFILES = SHIPPED_DIR
SHIPPED = sorted(PROFILES.glob("*/*.json"))
SM, MEM = DEFAULT_SM_LEVELS, DEFAULT_MEM_LEVELS


def _alone_value(kind: str, i: int, j: int) -> float | None:
    # "a" does not fit at the lowest memory level; values fall with both sm and memory.
    if kind == "a" and j == 0:
        return None
    return round(1.0 + 0.5 * (3 - i) + 0.1 * (3 - j) + (0.01 if kind == "b" else 0.0), 6)


def _pair_value(a: str, b: str, i: int, j: int) -> float | None:
    cj = 3 - j  # memory complement index for levels 0.2..0.8
    if (a == "a" and j == 0) or (b == "a" and cj == 0):
        return None
    return round(_alone_value(a, i, j) + 0.2 + 0.01 * (ord(b) - ord("a")), 6)


def valid_dict() -> dict:
    kinds = ["a", "b"]
    return {
        "format": "jigsaw-slowdown-grid", "version": 1,
        "device": {"sku": "TEST-GPU", "num_sms": 100, "mem_bytes": 80 * 2**30, "peak_flops": 1e15,
                   "mem_bw_bytes_per_s": 3e12},
        "model": "toy", "source": {"kind": "measured", "note": "hand-made test grid"},
        "sm_levels": list(SM), "mem_levels": list(MEM), "kinds": kinds,
        "alone": {k: [[_alone_value(k, i, j) for j in range(4)] for i in range(4)] for k in kinds},
        "pairs": {a: {b: [[_pair_value(a, b, i, j) for j in range(4)] for i in range(4)] for b in kinds}
                  for a in kinds},
    }


@pytest.fixture(scope="module")
def toy() -> SlowdownGrid:
    return SlowdownGrid.from_dict(valid_dict())


@pytest.fixture(scope="module", params=SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def shipped(request) -> SlowdownGrid:
    return load_grid(request.param)


def _raw(grid: SlowdownGrid, a: str, b: str | None) -> np.ndarray:
    d = grid.to_dict()
    table = d["alone"][a] if b is None else d["pairs"][a][b]
    return np.array([[np.nan if x is None else x for x in row] for row in table])


def _comp(levels, x) -> int:
    return min(range(len(levels)), key=lambda i: abs(levels[i] - (1.0 - x)))


# --- files --------------------------------------------------------------------------------


def test_shipped_grids_exist():
    assert len(SHIPPED) >= 7


def test_round_trip_dict(toy):
    d = valid_dict()
    assert toy.to_dict() == d
    assert SlowdownGrid.from_dict(toy.to_dict()) == toy


def test_round_trip_file(tmp_path, shipped):
    path = tmp_path / "sub" / "grid.json"
    shipped.save(path)
    again = SlowdownGrid.load(path)
    assert again == shipped and hash(again) == hash(shipped)
    assert again != SlowdownGrid.from_dict(valid_dict())
    assert again.to_dict() == shipped.to_dict()
    assert again.path == str(path)
    assert json.loads(path.read_text()) == shipped.to_dict()
    assert shipped.path is not None and Path(shipped.path).name.endswith(".json")


def test_grid_is_immutable(toy):
    with pytest.raises(AttributeError):
        toy.model = "other"
    toy.source["note"] = "changed"
    assert toy.source["note"] == "hand-made test grid"


# --- interpolation ------------------------------------------------------------------------


def test_grid_points_return_stored_values_exactly(shipped):
    SM, MEM = shipped.sm_levels, shipped.mem_levels  # a CPU grid has the levels its cores allow
    nulls_next_to_values = 0
    for a in shipped.kinds:
        raw = _raw(shipped, a, None)
        for (i, sm), (j, mem) in itertools.product(enumerate(SM), enumerate(MEM)):
            want = math.inf if np.isnan(raw[i, j]) else raw[i, j]
            assert shipped.alone(a, sm, mem) == want
            assert shipped.slowdown(a, None, sm, mem) == want
            if not np.isnan(raw[i, j]) and j > 0 and np.isnan(raw[i, j - 1]):
                nulls_next_to_values += 1
        for b in shipped.kinds:
            raw = _raw(shipped, a, b)
            for (i, sm), (j, mem) in itertools.product(enumerate(SM), enumerate(MEM)):
                want = math.inf if np.isnan(raw[i, j]) else raw[i, j]
                assert shipped.slowdown(a, b, sm, mem) == want, (a, b, sm, mem)
    if shipped.model in ("qwen3-4b", "qwen3-32b"):
        assert nulls_next_to_values > 0  # the exactness claim covers points beside nulls


class _NoInterpolation:
    def __call__(self, *_):
        raise AssertionError("a grid node was interpolated")


def test_grid_nodes_are_read_not_interpolated_and_give_the_interpolators_number(shipped):
    """Cold decisions query hundreds of grid nodes: each must be a table read (the
    interpolator costs ~0.1 ms a call) and equal what interpolation gives, bit for bit."""
    tables = [*shipped._alone_tables.values(), *shipped._shared_tables.values(), *shipped._part_tables.values()]
    nodes = 0
    for table in tables:
        axes = [sorted(level for level in axis) for axis in table._nodes]
        points = [(pt, fits) for pt in itertools.product(*axes) for fits in (False, True)]
        read, table._at = table._at, {}  # without its node table: the interpolation's answer
        try:
            want = {(pt, fits): table(*pt, fits=fits) for pt, fits in points}
        finally:
            table._at = read
        interp, table._interp = table._interp, _NoInterpolation()
        try:
            for (pt, fits), v in want.items():
                assert table(*pt, fits=fits) == v, (pt, fits)
                nodes += 1
        finally:
            table._interp = interp
    assert nodes > 100


def test_toy_grid_points_beside_nulls(toy):
    assert toy.alone("a", 0.5, 0.2) == math.inf
    assert toy.alone("a", 0.5, 0.4) == _alone_value("a", 1, 1)
    assert toy.alone("a", 0.5, 0.3) == math.inf  # a corner with weight is infeasible
    assert toy.slowdown("b", "a", 0.25, 0.6) == _pair_value("b", "a", 0, 2)
    assert toy.slowdown("b", "a", 0.25, 0.8) == math.inf  # a would get 0.2


def test_midpoint_is_average_of_neighbours(toy):
    corners = [_alone_value("b", i, j) for i in (1, 2) for j in (1, 2)]
    assert toy.alone("b", 0.625, 0.5) == pytest.approx(sum(corners) / 4, abs=1e-12)
    assert toy.alone("b", 0.5, 0.5) == pytest.approx((_alone_value("b", 1, 1) + _alone_value("b", 1, 2)) / 2)
    shared = (_pair_value("b", "b", 3, 1) + _pair_value("b", "b", 3, 2)) / 2
    assert toy.slowdown("b", "b", 1.0, 0.5) == pytest.approx(shared)
    part = (_pair_value("b", "b", 0, 2) + _pair_value("b", "b", 1, 2)) / 2
    assert toy.slowdown("b", "b", 0.375, 0.6) == pytest.approx(part)


def test_memory_clamps_above_top_and_is_infeasible_below(toy):
    assert toy.alone("b", 0.5, 0.95) == toy.alone("b", 0.5, 0.8)
    assert toy.alone("b", 0.5, 1.0) == toy.alone("b", 0.5, 0.8)
    assert toy.alone("b", 0.5, 0.1) == math.inf
    assert toy.slowdown("b", "b", 0.5, 0.1) == math.inf
    assert toy.slowdown("b", "b", 0.5, 0.9) == toy.slowdown("b", "b", 0.5, 0.8)
    assert toy.pair("b", "b", 0.5, 0.9) is None  # the partner would get 0.1
    assert toy.pair("b", "b", 0.5, 0.1) is None
    assert toy.alone("b", 0.5, 1 - 0.8) == _alone_value("b", 1, 0)  # 0.19999999999999996


def test_sm_range_and_unpartitioned_gap(toy):
    assert toy.alone("b", 0.9, 0.8) == pytest.approx(_alone_value("b", 2, 3) * 0.4 + _alone_value("b", 3, 3) * 0.6)
    for bad in (0.1, 1.2, math.nan):
        with pytest.raises(ValueError):
            toy.alone("b", bad, 0.8)
    with pytest.raises(ValueError, match="no partition"):
        toy.slowdown("a", "b", 0.9, 0.6)
    with pytest.raises(ValueError, match="no partition"):
        toy.pair("a", "b", 0.8, 0.6)
    with pytest.raises(ValueError):
        toy.slowdown("a", "b", 0.2, 0.6)
    with pytest.raises(ValueError):
        toy.alone("b", 0.5, math.nan)


def test_unknown_kind_names_known_ones(toy):
    for call in (lambda: toy.alone("zz", 1.0, 0.8), lambda: toy.slowdown("a", "zz", 1.0, 0.8),
                 lambda: toy.pair("zz", "a", 0.5, 0.4), lambda: toy.pair_options("a", "zz"),
                 lambda: toy.shared("zz", "a", 0.4)):
        with pytest.raises(KeyError, match="zz") as e:
            call()
        assert "'a'" in str(e.value) and "'b'" in str(e.value)


def test_pair_follows_complement_rule(shipped):
    SM, MEM = shipped.sm_levels, shipped.mem_levels
    for a, b in itertools.product(shipped.kinds, repeat=2):
        ours, theirs = _raw(shipped, a, b), _raw(shipped, b, a)
        for (i, sm), (j, mem) in itertools.product(enumerate(SM), enumerate(MEM)):
            ci = i if sm == 1.0 else _comp(SM, sm)
            cj = _comp(MEM, mem)
            got = shipped.pair(a, b, sm, mem)
            if np.isnan(ours[i, j]):
                assert got is None
            else:
                assert got == (ours[i, j], theirs[ci, cj])
            if sm == 1.0:
                assert shipped.shared(a, b, mem) == got


def test_pair_options_are_the_feasible_partitioned_points(shipped):
    SM, MEM = shipped.sm_levels, shipped.mem_levels
    best = 1.0
    for a, b in itertools.product(shipped.kinds, repeat=2):
        opts = shipped.pair_options(a, b)
        assert shipped.pair_options(a, b) is opts  # cached, not rebuilt
        raw = _raw(shipped, a, b)
        want = {(sm, mem) for (i, sm), (j, mem) in itertools.product(enumerate(SM[:-1]), enumerate(MEM))
                if not np.isnan(raw[i, j])}
        assert {(sm, mem) for sm, mem, _, _ in opts} == want
        for sm, mem, s_a, s_b in opts:
            assert sm < 1.0
            assert (s_a, s_b) == shipped.pair(a, b, sm, mem)
            best = max(best, 1 / s_a + 1 / s_b)
    assert shipped.max_pack_efficiency() == best >= 1.0


def test_pair_options_of_toy(toy):
    opts = toy.pair_options("a", "b")
    assert all(mem != 0.2 for _, mem, _, _ in opts)  # "a" never fits at 0.2
    assert len(opts) == 3 * 3
    assert toy.max_pack_efficiency() >= 1.0


def _cell_corners(levels, x):
    hi = next(i for i, level in enumerate(levels) if level >= x)
    return {max(hi - 1, 0), hi} if levels[hi] != x else {hi}


@settings(max_examples=200, deadline=None)
@given(sm=st.floats(0.25, 1.0), mem=st.floats(0.2, 0.8), kind=st.sampled_from(["a", "b"]),
       partner=st.sampled_from([None, "a", "b"]))
def test_interpolated_value_lies_within_its_cell(toy, sm, mem, kind, partner):
    if partner is not None and 0.75 < sm < 1.0:
        sm = 0.75
    value = toy.slowdown(kind, partner, sm, mem)
    table = _raw(toy, kind, partner)
    rows = {3} if partner is not None and sm == 1.0 else _cell_corners(SM[:-1] if partner else SM, sm)
    corners = [table[i, j] for i in rows for j in _cell_corners(MEM, mem)]
    if math.isinf(value):
        assert any(np.isnan(c) for c in corners)
        return
    assert min(corners) - 1e-12 <= value <= max(corners) + 1e-12


# --- validation ---------------------------------------------------------------------------


def _set(path: str, value):
    def mutate(d):
        *parents, last = path.split("/")
        node = d
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return mutate


def _delete(path: str):
    def mutate(d):
        *parents, last = path.split("/")
        node = d
        for key in parents:
            node = node[key]
        del node[last]
    return mutate


def _asymmetric_null(d):
    d["pairs"]["a"]["b"][0][2] = None  # its complement pairs.b.a[2][1] stays feasible


MALFORMED = [
    ("wrong format", _set("format", "other-format"), "format", "jigsaw-slowdown-grid"),
    ("version 2", _set("version", 2), "version", "supported versions: [1]"),
    ("missing device field", _delete("device/num_sms"), "device.num_sms", "missing"),
    ("negative num_sms", _set("device/num_sms", -4), "device.num_sms", "must be positive"),
    ("float num_sms", _set("device/num_sms", 1.5), "device.num_sms", "expected an integer"),
    ("zero bandwidth", _set("device/mem_bw_bytes_per_s", 0), "device.mem_bw_bytes_per_s", "must be positive"),
    ("unknown device field", _set("device/color", "green"), "device.color", "unknown field"),
    ("empty model", _set("model", ""), "model", "non-empty string"),
    ("bad source kind", _set("source/kind", "guess"), "source.kind", "analytic-prior"),
    ("missing note", _delete("source/note"), "source.note", "expected a string"),
    ("non-increasing levels", _set("sm_levels", [0.25, 0.75, 0.5, 1.0]), "sm_levels[2]", "strictly increasing"),
    ("sm levels not ending at 1", _set("sm_levels", [0.25, 0.5, 0.75]), "sm_levels[2]", "end at 1.0"),
    ("sm level outside (0,1]", _set("sm_levels", [0.0, 0.5, 1.0]), "sm_levels[0]", "(0, 1]"),
    ("sm levels not closed", _set("sm_levels", [0.25, 0.5, 0.6, 1.0]), "sm_levels[0]", "complement"),
    ("mem levels not closed", _set("mem_levels", [0.2, 0.4, 0.7, 0.8]), "mem_levels[1]", "complement"),
    ("empty levels", _set("mem_levels", []), "mem_levels", "non-empty"),
    ("duplicate kind", _set("kinds", ["a", "a"]), "kinds[1]", "duplicate"),
    ("empty kinds", _set("kinds", []), "kinds", "non-empty"),
    ("missing alone kind", _delete("alone/b"), "alone.b", "missing"),
    ("extra alone kind", _set("alone/c", [[1.0] * 4] * 4), "alone.c", "not a listed kind"),
    ("wrong row count", _set("alone/a", [[1.0] * 4] * 3), "alone.a", "expected 4 rows"),
    ("wrong row length", _set("pairs/a/b/2", [1.0] * 3), "pairs.a.b[2]", "expected 4 values"),
    ("value 0.3", _set("pairs/b/a/2/1", 0.3), "pairs.b.a[2][1]", "noise floor"),
    ("NaN value", _set("alone/b/1/1", math.nan), "alone.b[1][1]", "finite"),
    ("inf value", _set("pairs/a/a/0/3", math.inf), "pairs.a.a[0][3]", "finite"),
    ("string value", _set("alone/b/0/0", "2.0"), "alone.b[0][0]", "finite number or null"),
    ("normalisation 1.3", _set("alone/a/3/3", 1.3), "alone.a[3][3]", "normalisation point"),
    ("null normalisation", _set("alone/b/3/3", None), "alone.b[3][3]", "normalisation point"),
    ("missing pair", _delete("pairs/b/a"), "pairs.b.a", "missing"),
    ("missing outer pair", _delete("pairs/a"), "pairs.a", "missing"),
    ("extra pair", _set("pairs/a/c", [[1.0] * 4] * 4), "pairs.a.c", "not a listed kind"),
    ("asymmetric null", _asymmetric_null, "pairs.a.b[0][2]", "pairs.b.a[2][1] is not"),
    ("unknown top-level key", _set("comment", "hi"), "comment", "unknown top-level key"),
    ("missing top-level key", _delete("pairs"), "pairs", "missing"),
]


@pytest.mark.parametrize("mutate, field, problem", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_file_names_path_field_and_problem(tmp_path, mutate, field, problem):
    data = copy.deepcopy(valid_dict())
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))  # NaN/Infinity are written as JSON extensions on purpose
    with pytest.raises(SlowdownFileError) as e:
        SlowdownGrid.load(path)
    assert (e.value.path, e.value.field) == (str(path), field)
    assert problem in e.value.problem
    assert str(e.value) == f"{path}: {field}: {e.value.problem}"
    with pytest.raises(SlowdownFileError, match="<dict>"):
        SlowdownGrid.from_dict(data)


def test_invalid_json_text(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"format": "jigsaw-slowdown-grid", ')
    with pytest.raises(SlowdownFileError) as e:
        load_grid(path)
    assert e.value.field == "<file>" and str(path) in str(e.value) and "invalid JSON" in str(e.value)


def test_top_level_must_be_an_object():
    with pytest.raises(SlowdownFileError, match="<root>"):
        SlowdownGrid.from_dict([1, 2])  # type: ignore[arg-type]


def test_valid_dict_is_valid():
    assert SlowdownGrid.from_dict(valid_dict()).kinds == ("a", "b")


def test_import_does_not_pull_torch():
    code = "import sys, jigsaw.mux.model.slowdown, jigsaw.mux.model.prior; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=PROFILES.parent).returncode == 0
