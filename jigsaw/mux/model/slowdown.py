"""Slowdown grid: file format v1, validation and interpolation (paper §4.2 "Slowdown Modeling").

    profiles/<sku>/<model>.prior.json ─json─► from_dict (validate) ─► SlowdownGrid
          ▲                                                             │ _Table per (kind) and
          └──────────── save ◄── to_dict ◄─────────────────────────────┤ per (kind, partner)
                                                                        ▼
              scheduler ◄── slowdown() / pair() / pair_options() / max_pack_efficiency()

`s(kA, kB, σA, memA)` is the duration of kind kA holding SM share σA and memory share memA
while kB runs beside it with the rest, over kA's exclusive duration (whole device, top
memory level).  For a pair σA < 1 is a green-context partition (kB gets 1-σA) and σA = 1.0
is unpartitioned, MPS-style sharing in which kB also sees every SM.  kB = None is kA alone
under that budget.  The partner's view of a point is (kB, kA, σB, 1-memA) with
σB = 1-σA if σA < 1 else 1.0.  Kinds are plain names so `mux/model/` does not depend on `graph/`.

Feasibility, per side of a query:
    need unknown        any infeasible corner with weight ─► infeasible (the grid's null may be
                        exactly what the sub-stage needs)
    need_frac given     need > budget ─► infeasible; else the interpolation among the feasible
    (its need over the  corners only (`_Table`); behind a partition, where the partner's table
    device's memory)    has no feasible corner, the slowest partner the grid prices there
                        (`_beside_any`); still nothing ─► infeasible
A stored value is answered as stored either way: only nulls and the cells beside them change,
and the scheduler, which plans at grid points (`pair_options`), sees the same table.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

FORMAT = "jigsaw-slowdown-grid"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
DEFAULT_SM_LEVELS = (0.25, 0.5, 0.75, 1.0)
DEFAULT_MEM_LEVELS = (0.2, 0.4, 0.6, 0.8)
SOURCE_KINDS = ("analytic-prior", "measured")
NOISE_FLOOR = 0.5
"""Smallest slowdown a file may hold.  Under 1.0 is noise, or real: a small decode batch runs
faster on one CPU core than on two threads that synchronise (the shipped cpu/tiny-qwen3 holds 0.83); far
below is a bug."""
NORM_TOL = 0.02
"""Allowed distance of the normalisation point (alone, σ=1.0, top memory level) from 1.0."""
LEVEL_TOL = 1e-9
"""Queries and complements within this of a level are that level (1-0.8 is 0.19999999999999996)."""
_WEIGHT_TOL = 1e-12
"""Interpolation weight below which feasible corners carry nothing (floating-point residue)."""

_TOP_KEYS = ("format", "version", "device", "model", "source", "sm_levels", "mem_levels",
             "kinds", "alone", "pairs")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    """The accelerator a grid was measured (or modelled) on."""

    sku: str
    """Marketing name with form factor and memory, e.g. "H100-SXM5-80GB"."""
    num_sms: int
    """Streaming multiprocessors on the device; SM shares are fractions of this."""
    mem_bytes: int
    """Device memory capacity; memory shares are fractions of this."""
    peak_flops: float
    """Dense BF16 tensor-core peak, FLOP/s."""
    mem_bw_bytes_per_s: float
    """Peak HBM bandwidth, bytes/s."""


class SlowdownFileError(ValueError):
    """A grid file (or dict) that breaks format v1; says where and what."""

    def __init__(self, path: str, field: str, problem: str):
        self.path = path
        self.field = field
        self.problem = problem
        super().__init__(f"{path}: {field}: {problem}")


# ---------------------------------------------------------------------------------------
# validation: each check raises SlowdownFileError(path, field, problem) on the first fault


def _is_number(x: Any) -> bool:
    # NOTE: bool is an int subclass; `true` in a grid file is a typo, not a slowdown.
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _level_index(levels: tuple[float, ...], x: float) -> int | None:
    for i, level in enumerate(levels):
        if abs(level - x) <= LEVEL_TOL:
            return i
    return None


class _Checker:
    """Validates one parsed file; `path` only labels the errors."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, field: str, problem: str) -> SlowdownFileError:
        return SlowdownFileError(self.path, field, problem)

    def header(self, data: Any) -> None:
        if not isinstance(data, Mapping):
            raise self.fail("<root>", f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise self.fail("format", f"expected {FORMAT!r}, got {data.get('format')!r}")
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
            raise self.fail("version", f"unsupported version {version!r}; supported versions: "
                                       f"{list(SUPPORTED_VERSIONS)}")
        for key in data:
            if key not in _TOP_KEYS:
                raise self.fail(str(key), f"unknown top-level key; expected only {list(_TOP_KEYS)}")
        for key in _TOP_KEYS:
            if key not in data:
                raise self.fail(key, "missing")

    def device(self, raw: Any) -> DeviceInfo:
        if not isinstance(raw, Mapping):
            raise self.fail("device", "expected an object")
        fields = {"sku": str, "num_sms": int, "mem_bytes": int, "peak_flops": float,
                  "mem_bw_bytes_per_s": float}
        for key in raw:
            if key not in fields:
                raise self.fail(f"device.{key}", f"unknown field; expected {list(fields)}")
        values = {}
        for key, kind in fields.items():
            field, value = f"device.{key}", raw.get(key)
            if value is None:
                raise self.fail(field, "missing")
            if kind is str:
                if not isinstance(value, str) or not value:
                    raise self.fail(field, "expected a non-empty string")
            elif kind is int and (not isinstance(value, int) or isinstance(value, bool)):
                raise self.fail(field, f"expected an integer, got {value!r}")
            elif not _is_number(value) or not math.isfinite(value):
                raise self.fail(field, f"expected a finite number, got {value!r}")
            if kind is not str and value <= 0:
                raise self.fail(field, f"must be positive, got {value!r}")
            values[key] = float(value) if kind is float else value
        return DeviceInfo(**values)

    def header_fields(self, data: Mapping) -> tuple[str, dict]:
        model, source = data["model"], data["source"]
        if not isinstance(model, str) or not model:
            raise self.fail("model", "expected a non-empty string")
        if not isinstance(source, Mapping):
            raise self.fail("source", "expected an object")
        if source.get("kind") not in SOURCE_KINDS:
            raise self.fail("source.kind", f"expected one of {list(SOURCE_KINDS)}, got {source.get('kind')!r}")
        if not isinstance(source.get("note"), str):
            raise self.fail("source.note", "expected a string saying what the numbers are")
        return model, copy.deepcopy(dict(source))

    def levels(self, field: str, raw: Any, *, is_sm: bool) -> tuple[float, ...]:
        if not isinstance(raw, list) or not raw:
            raise self.fail(field, "expected a non-empty list of fractions")
        for i, x in enumerate(raw):
            if not _is_number(x) or not math.isfinite(x) or not 0.0 < x <= 1.0:
                raise self.fail(f"{field}[{i}]", f"expected a fraction in (0, 1], got {x!r}")
            if i and x <= raw[i - 1]:
                raise self.fail(f"{field}[{i}]", f"not strictly increasing ({x!r} after {raw[i - 1]!r})")
        levels = tuple(float(x) for x in raw)
        if is_sm:
            if abs(levels[-1] - 1.0) > LEVEL_TOL:
                raise self.fail(f"{field}[{len(raw) - 1}]", f"sm levels must end at 1.0, got {levels[-1]!r}")
            levels = levels[:-1] + (1.0,)
        closed = levels[:-1] if is_sm else levels
        for i, x in enumerate(closed):
            if _level_index(closed, 1.0 - x) is None:
                what = "partitioned sm" if is_sm else "memory"
                raise self.fail(f"{field}[{i}]", f"{what} level {x!r} has no complement {1.0 - x!r}; "
                                                 f"{what} levels must be closed under x -> 1-x")
        return levels

    def kinds(self, raw: Any) -> tuple[str, ...]:
        if not isinstance(raw, list) or not raw:
            raise self.fail("kinds", "expected a non-empty list of kind names")
        for i, k in enumerate(raw):
            if not isinstance(k, str) or not k:
                raise self.fail(f"kinds[{i}]", f"expected a non-empty string, got {k!r}")
            if k in raw[:i]:
                raise self.fail(f"kinds[{i}]", f"duplicate kind {k!r}")
        return tuple(raw)

    def keys(self, field: str, raw: Any, kinds: tuple[str, ...]) -> None:
        if not isinstance(raw, Mapping):
            raise self.fail(field, "expected an object keyed by kind")
        for k in kinds:
            if k not in raw:
                raise self.fail(f"{field}.{k}", "missing")
        for k in raw:
            if k not in kinds:
                raise self.fail(f"{field}.{k}", f"not a listed kind; kinds are {list(kinds)}")

    def table(self, field: str, raw: Any, shape: tuple[int, int]) -> np.ndarray:
        """A [sm][mem] table of slowdowns; null (infeasible) becomes NaN."""
        if not isinstance(raw, list) or len(raw) != shape[0]:
            raise self.fail(field, f"expected {shape[0]} rows (one per sm level), got "
                                   f"{len(raw) if isinstance(raw, list) else type(raw).__name__}")
        out = np.full(shape, np.nan)
        for i, row in enumerate(raw):
            if not isinstance(row, list) or len(row) != shape[1]:
                raise self.fail(f"{field}[{i}]", f"expected {shape[1]} values (one per memory level)")
            for j, x in enumerate(row):
                if x is None:
                    continue
                if not _is_number(x) or not math.isfinite(x):
                    raise self.fail(f"{field}[{i}][{j}]", f"expected a finite number or null, got {x!r}")
                if x < NOISE_FLOOR:
                    raise self.fail(f"{field}[{i}][{j}]", f"slowdown {x!r} below the measurement-noise "
                                                          f"floor {NOISE_FLOOR}")
                out[i, j] = float(x)
        out.flags.writeable = False
        return out

    def normalisation(self, kind: str, table: np.ndarray) -> None:
        i, j = table.shape[0] - 1, table.shape[1] - 1
        x = table[i, j]
        if not abs(x - 1.0) <= NORM_TOL:  # NaN fails too
            raise self.fail(f"alone.{kind}[{i}][{j}]", "normalisation point (alone, sm 1.0, top memory "
                                                       f"level) must be 1.0 ± {NORM_TOL}, got "
                                                       f"{None if math.isnan(x) else x}")

    def symmetry(self, pairs: dict, sm: tuple[float, ...], mem: tuple[float, ...]) -> None:
        sm_comp = [i if x == 1.0 else _level_index(sm, 1.0 - x) for i, x in enumerate(sm)]
        mem_comp = [_level_index(mem, 1.0 - x) for x in mem]
        for (a, b), table in pairs.items():
            other = pairs[(b, a)]
            for i, j in np.ndindex(table.shape):
                ci, cj = sm_comp[i], mem_comp[j]
                if np.isnan(table[i, j]) != np.isnan(other[ci, cj]):
                    here = "null" if np.isnan(table[i, j]) else "feasible"
                    raise self.fail(f"pairs.{a}.{b}[{i}][{j}]", f"{here} here but pairs.{b}.{a}[{ci}][{cj}] "
                                                                "is not; feasibility must be symmetric")


# ---------------------------------------------------------------------------------------
# interpolation


class _Table:
    """Linear interpolation of one table that knows which corners are infeasible.

    Values and a 0/1 infeasibility mask are interpolated together; the interpolated mask is
    the weight the infeasible corners carry.  Infeasible values are stored as 0.0 (never
    used) so NaN cannot leak into a feasible answer.

    Without `fits`, any infeasible corner with non-zero weight makes the query infeasible.
    With `fits` (the caller knows the sub-stage's need fits its budget) the answer is the
    interpolation among the feasible corners only, their weights renormalised: value /
    (1 - mask).  Why this and not a clamp or an extrapolation: a null corner has no number
    to use; extrapolating below a feasible level would invent one; the memory axis prices
    what a budget leaves beyond the need (micro-batch, KV pool), so the feasible neighbours
    are the evidence.  In one dimension it is the value at the nearest feasible level (the
    one above for a budget over an infeasible lower level, i.e. a clamp up to where the
    grid ran it; the one below when the partner's complement is what is null there, the
    pessimistic side).  Where every corner is feasible it is the plain interpolation, and
    an exact grid point is its stored value (or still infeasible when null): nothing changes
    where nothing was infeasible.

    A point on grid nodes (every budget the scheduler grants: callers snap to levels) is read
    from the table: linear weights there are exactly 1 and 0, so the answer is the same number
    the interpolation gives, without its ~0.1 ms per call (cold decisions make hundreds).
    """

    __slots__ = ("_interp", "_nodes", "_at")

    def __init__(self, axes: tuple[tuple[float, ...], ...], values: np.ndarray):
        mask = np.isnan(values)
        stacked = np.stack([np.where(mask, 0.0, values), mask.astype(float)], axis=-1)
        from scipy.interpolate import RegularGridInterpolator  # here: keeps `jigsaw --help` light

        self._interp = RegularGridInterpolator(axes, stacked, method="linear", bounds_error=True)
        self._nodes = tuple({float(level): i for i, level in enumerate(axis)} for axis in axes)
        self._at = {idx: (math.inf if np.isnan(v) else float(v)) for idx, v in np.ndenumerate(values)}

    def __call__(self, *point: float, fits: bool = False) -> float:
        try:
            return self._at[tuple(nodes[x] for nodes, x in zip(self._nodes, point, strict=True))]
        except KeyError:
            pass
        value, infeasible = self._interp(np.array([point]))[0]
        if infeasible <= 0.0:
            return float(value)
        feasible_weight = 1.0 - infeasible
        if not fits or feasible_weight <= _WEIGHT_TOL:
            return math.inf
        return float(value / feasible_weight)


def _fits(need_frac: float | None, mem_frac: float) -> bool:
    """Whether a need (None: unknown, the grid decides) fits a memory budget."""
    if need_frac is None:
        return True
    if math.isnan(need_frac) or need_frac < 0.0:
        raise ValueError(f"need_frac must be a non-negative fraction, got {need_frac!r}")
    return need_frac <= mem_frac + LEVEL_TOL


def _snap(x: float, levels: tuple[float, ...]) -> float:
    i = _level_index(levels, x)
    return x if i is None else levels[i]


def _as_list(table: np.ndarray) -> list[list[float | None]]:
    return [[None if math.isnan(x) else float(x) for x in row] for row in table]


_ROW = re.compile(r"\[([^\[\]\"{}]*)\]")
"""An innermost JSON list of numbers/nulls: saved on one line so a table reads as a grid."""


class SlowdownGrid:
    """One device's and one model's slowdown table; immutable, built by `from_dict`/`load`.

    Tables are indexed [sm level][memory level].  `alone[k]` is k alone under a budget;
    `pairs[(a, b)]` is a beside b, whose last sm row (σ = 1.0) is unpartitioned sharing.
    """

    FORMAT = FORMAT
    VERSION = VERSION
    __slots__ = ("device", "model", "_source", "kinds", "sm_levels", "mem_levels", "path", "_alone",
                 "_pairs", "_alone_tables", "_part_tables", "_shared_tables", "_options", "_max_pack", "_hash",
                 "_actual")

    def __init__(self, *, device: DeviceInfo, model: str, source: dict, sm_levels: tuple[float, ...],
                 mem_levels: tuple[float, ...], kinds: tuple[str, ...], alone: dict[str, np.ndarray],
                 pairs: dict[tuple[str, str], np.ndarray], path: str | None = None):
        """Indexes already-validated tables; call `from_dict` or `load`, which validate."""
        fields = {"device": device, "model": model, "_source": source, "sm_levels": sm_levels,
                  "mem_levels": mem_levels, "kinds": kinds, "_alone": alone, "_pairs": pairs, "path": path}
        part = sm_levels[:-1]
        fields["_alone_tables"] = {k: _Table((sm_levels, mem_levels), t) for k, t in alone.items()}
        fields["_shared_tables"] = {ab: _Table((mem_levels,), t[-1]) for ab, t in pairs.items()}
        fields["_part_tables"] = {ab: _Table((part, mem_levels), t[:-1]) for ab, t in pairs.items()} if part else {}
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        options = {ab: self._grid_options(*ab) for ab in pairs}
        # NOTE: running the two back to back is always possible, so packing is worth >= 1.
        efficiency = max([1.0, *(1 / sa + 1 / sb for opts in options.values() for _, _, sa, sb in opts)])
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "_actual", {})
        object.__setattr__(self, "_max_pack", efficiency)
        object.__setattr__(self, "_hash", hash(json.dumps(self.to_dict(), sort_keys=True)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"SlowdownGrid is immutable (tried to set {name!r})")

    def __eq__(self, other: object) -> bool:
        """Same content (where it was loaded from does not matter)."""
        return isinstance(other, SlowdownGrid) and self._hash == other._hash and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return (f"SlowdownGrid(device={self.device.sku!r}, model={self.model!r}, "
                f"source={self._source['kind']!r}, kinds={list(self.kinds)}, path={self.path!r})")

    @property
    def source(self) -> dict:
        """Where the numbers come from ({"kind": "analytic-prior" | "measured", "note": ...}); a copy."""
        return copy.deepcopy(self._source)

    # --- construction and files ---------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping, *, path: str = "<dict>") -> SlowdownGrid:
        """Validate a parsed v1 file; every fault raises SlowdownFileError(path, field, problem)."""
        return cls(**_parse(data, path), path=None if path == "<dict>" else path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SlowdownGrid:
        """Load and validate a grid file, or a grid by name ("h100/qwen3-4b", see jigsaw.profiles)."""
        from jigsaw.profiles import resolve

        path_str = os.fspath(resolve(path))
        try:
            with open(path_str, encoding="utf-8") as f:
                data = json.load(f)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise SlowdownFileError(path_str, "<file>", f"invalid JSON: {e}") from e
        return cls.from_dict(data, path=path_str)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "device": asdict(self.device), "model": self.model,
            "source": self.source, "sm_levels": list(self.sm_levels), "mem_levels": list(self.mem_levels),
            "kinds": list(self.kinds),
            "alone": {k: _as_list(self._alone[k]) for k in self.kinds},
            "pairs": {a: {b: _as_list(self._pairs[(a, b)]) for b in self.kinds} for a in self.kinds},
        }

    def save(self, path: str | os.PathLike) -> None:
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False, ensure_ascii=False)
        text = _ROW.sub(lambda m: "[" + re.sub(r"\s+", " ", m.group(1)).strip() + "]", text)
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")

    # --- queries --------------------------------------------------------------------------

    def alone(self, kind: str, sm_frac: float, mem_frac: float, *, need_frac: float | None = None) -> float:
        """Slowdown of `kind` alone under (sm_frac, mem_frac); math.inf if it does not fit.

        `need_frac`: what the sub-stage needs, over the device's memory; when given, it decides
        feasibility (need ≤ budget) and the grid prices the budget from its feasible points."""
        self._check_kind(kind)
        sm = self._sm(sm_frac, self.sm_levels[0], 1.0)
        mem = self._mem(mem_frac)
        if mem is None or not _fits(need_frac, mem_frac):
            return math.inf
        return self._alone_tables[kind](sm, mem, fits=need_frac is not None)

    def slowdown(self, kind_a: str, kind_b: str | None, sm_frac_a: float, mem_frac_a: float, *,
                 need_frac_a: float | None = None) -> float:
        """s(kind_a beside kind_b); kind_b None means alone.  math.inf if infeasible.

        Memory above the top level clamps to it, below the lowest level is infeasible.  For a
        pair, σ interpolates only among partitioned levels; σ == 1.0 is the shared row.
        `need_frac_a` as `alone`'s `need_frac`.
        """
        if kind_b is None:
            return self.alone(kind_a, sm_frac_a, mem_frac_a, need_frac=need_frac_a)
        self._check_kind(kind_a)
        self._check_kind(kind_b)
        part = self.sm_levels[:-1]
        sm = self._sm(sm_frac_a, part[0] if part else 1.0, 1.0)
        if sm != 1.0 and sm > part[-1]:
            raise ValueError(f"no partition at sm_frac {sm_frac_a!r}: partitioned levels end at "
                             f"{part[-1]!r} and 1.0 means unpartitioned sharing")
        mem = self._mem(mem_frac_a)
        if mem is None or not _fits(need_frac_a, mem_frac_a):
            return math.inf
        fits = need_frac_a is not None
        if sm == 1.0:
            return self._shared_tables[(kind_a, kind_b)](mem, fits=fits)
        got = self._part_tables[(kind_a, kind_b)](sm, mem, fits=fits)
        return self._beside_any(kind_a, sm, mem) if fits and math.isinf(got) else got

    def pair(self, kind_a: str, kind_b: str, sm_frac_a: float, mem_frac_a: float, *,
             need_frac_a: float | None = None, need_frac_b: float | None = None) -> tuple[float, float] | None:
        """(s_a, s_b) with kind_b holding the complement; None if either side is infeasible."""
        s_a = self.slowdown(kind_a, kind_b, sm_frac_a, mem_frac_a, need_frac_a=need_frac_a)
        sm_a = _snap(sm_frac_a, self.sm_levels)
        s_b = self.slowdown(kind_b, kind_a, 1.0 if sm_a == 1.0 else 1.0 - sm_a, 1.0 - mem_frac_a,
                            need_frac_a=need_frac_b)
        return None if math.isinf(s_a) or math.isinf(s_b) else (s_a, s_b)

    def shared(self, kind_a: str, kind_b: str, mem_frac_a: float, *, need_frac_a: float | None = None,
               need_frac_b: float | None = None) -> tuple[float, float] | None:
        """Unpartitioned (σ = 1.0, MPS-style) pair; see `pair`."""
        return self.pair(kind_a, kind_b, 1.0, mem_frac_a, need_frac_a=need_frac_a, need_frac_b=need_frac_b)

    def pair_options(self, kind_a: str, kind_b: str) -> tuple[tuple[float, float, float, float], ...]:
        """Every feasible partitioned grid point as (sm_frac_a, mem_frac_a, s_a, s_b); O(1)."""
        try:
            return self._options[(kind_a, kind_b)]
        except KeyError:
            self._check_kind(kind_a)
            self._check_kind(kind_b)
            raise

    def actual(self, *units: tuple) -> tuple[float, ...] | None:
        """Slowdowns of what really shares a device, each unit (kind, sm_frac, mem_frac) of its
        budget, or (kind, sm_frac, mem_frac, need_frac) where its need is known (None: not):
        one alone (1.0 on the whole device), or a pair (σ < 1: partitioned; both 1.0:
        unpartitioned sharing).  None for an infeasible pair.  Memoised: executors ask for the
        same few points over and over."""
        got = self._actual.get(units)
        if got is None and units not in self._actual:
            got = self._actual[units] = self._occupancy(units)
        return got

    def _occupancy(self, units: tuple[tuple, ...]) -> tuple[float, ...] | None:
        if len(units) == 1:
            (kind, sm, mem, *need), = units
            need_frac = need[0] if need else None
            if sm >= 1.0 - LEVEL_TOL and mem >= self.mem_levels[-1] - LEVEL_TOL and _fits(need_frac, mem):
                return (1.0,)
            return (self.alone(kind, min(sm, 1.0), mem, need_frac=need_frac),)  # memory clamps in `_mem`
        if len(units) != 2:
            raise ValueError(f"a device holds at most two sub-stages, got {len(units)}")
        (ka, sa, ma, *na), (kb, _, _, *nb) = units
        needs = {"need_frac_a": na[0] if na else None, "need_frac_b": nb[0] if nb else None}
        pair = self.shared(ka, kb, ma, **needs) if sa >= 1.0 - LEVEL_TOL else self.pair(ka, kb, sa, ma, **needs)
        return pair

    def max_pack_efficiency(self) -> float:
        """max over feasible partitioned pair points of 1/s_a + 1/s_b, and at least 1.0."""
        return self._max_pack

    # --- helpers --------------------------------------------------------------------------

    def _beside_any(self, kind_a: str, sm: float, mem: float) -> float:
        """A partitioned side whose need fits but whose partner's table has no feasible corner
        around (sm, mem): the nulls there are the partner not fitting the complement level
        (two 14B trainings needing 38 GiB each have no 0.4/0.6 split), which the partner's own
        need decides (see `pair`).  Behind a partition the partner reaches it only through
        HBM, so it is priced as the slowest partner the grid does price there; math.inf if none."""
        got = [x for (a, _), table in self._part_tables.items()
               if a == kind_a and math.isfinite(x := table(sm, mem, fits=True))]
        return max(got, default=math.inf)

    def _check_kind(self, kind: str) -> None:
        if kind not in self._alone:
            raise KeyError(f"unknown sub-stage kind {kind!r}; this grid knows {list(self.kinds)}")

    def _sm(self, sm_frac: float, low: float, high: float) -> float:
        if not math.isfinite(sm_frac):
            raise ValueError(f"sm_frac must be finite, got {sm_frac!r}")
        sm = _snap(sm_frac, self.sm_levels)
        if not low <= sm <= high:
            raise ValueError(f"sm_frac {sm_frac!r} outside the profiled range [{low}, {high}]")
        return sm

    def _mem(self, mem_frac: float) -> float | None:
        """The memory coordinate to look up, or None when below the lowest level."""
        if math.isnan(mem_frac):
            raise ValueError("mem_frac is NaN")
        mem = _snap(mem_frac, self.mem_levels)
        if mem < self.mem_levels[0]:
            return None
        return min(mem, self.mem_levels[-1])  # NOTE: more memory than profiled never slows.

    def _grid_options(self, a: str, b: str) -> tuple[tuple[float, float, float, float], ...]:
        ours, theirs = self._pairs[(a, b)], self._pairs[(b, a)]
        out = []
        for i, sm in enumerate(self.sm_levels[:-1]):
            ci = _level_index(self.sm_levels, 1.0 - sm)
            for j, mem in enumerate(self.mem_levels):
                cj = _level_index(self.mem_levels, 1.0 - mem)
                if not np.isnan(ours[i, j]):
                    out.append((sm, mem, float(ours[i, j]), float(theirs[ci, cj])))
        return tuple(out)


def _parse(data: Any, path: str) -> dict[str, Any]:
    """Validated constructor arguments of SlowdownGrid from a parsed file."""
    check = _Checker(path)
    check.header(data)
    device = check.device(data["device"])
    model, source = check.header_fields(data)
    sm = check.levels("sm_levels", data["sm_levels"], is_sm=True)
    mem = check.levels("mem_levels", data["mem_levels"], is_sm=False)
    kinds = check.kinds(data["kinds"])
    shape = (len(sm), len(mem))
    check.keys("alone", data["alone"], kinds)
    alone = {k: check.table(f"alone.{k}", data["alone"][k], shape) for k in kinds}
    for k in kinds:
        check.normalisation(k, alone[k])
    check.keys("pairs", data["pairs"], kinds)
    pairs = {}
    for a in kinds:
        check.keys(f"pairs.{a}", data["pairs"][a], kinds)
        for b in kinds:
            pairs[(a, b)] = check.table(f"pairs.{a}.{b}", data["pairs"][a][b], shape)
    check.symmetry(pairs, sm, mem)
    return {"device": device, "model": model, "source": source, "sm_levels": sm, "mem_levels": mem,
            "kinds": kinds, "alone": alone, "pairs": pairs}


def load_grid(path: str | os.PathLike) -> SlowdownGrid:
    """Load and validate a grid file or a named grid (shorthand for SlowdownGrid.load)."""
    return SlowdownGrid.load(path)
