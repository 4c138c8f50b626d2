"""A slowdown grid learned online: a base grid refined from every finished grant.

    finished grant (node/learning.py): its wall seconds under each grid entry it ran at,
    │   and its exclusive seconds known independently (the requester's own estimate, or a
    │   static graph): never the ledger's own integration, which is the grid's prediction
    ▼
    observe(segments, reference_s) ─► the entry holding most of its wall time (≥ min_share_frac)
    │   s = its wall / (reference − the other segments' work at their current estimates),
    │   the others settled (min_samples each, or the normalisation point) or it is not evidence
    ▼   x = log(s / base value) ─► that entry's _Stats: count, the last `window` x
    correction = clamp(median(x) · τ² / (τ² + spread²/n), log min_factor, log max_factor),
    │   0 while count < min_samples                                   (the rule, LearnConfig)
    ▼
    refined() ─► SlowdownGrid of the base's shape, base × e^correction, validated by
                 SlowdownGrid.from_dict (nulls stay null, the normalisation point never moves)
                 ─► NodeState.grid: the scheduler plans with it from the next decision on
    save / load ─► <profile dir>/learned/<node>/<device sku>/<model>.json (`learned_path`)

An entry is (kind, partner, sm level, memory level): partner None is the kind alone, and a
pair's last sm level (1.0) is unpartitioned sharing, as in slowdown.py.  Memory is bounded by
the grid: one _Stats per entry, each at most `window` floats.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import socket
import statistics
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jigsaw.mux.model.slowdown import NOISE_FLOOR, SlowdownGrid

FORMAT = "jigsaw-learned-grid"
VERSION = 1
MAD_TO_SD = 1.4826
"""Median absolute deviation to standard deviation under normal noise."""
MAX_ABS_LOG = 3.0
"""A sample beyond e^±3 (20×) is a broken measurement: stored at this bound, never as inf."""

Entry = tuple[str, str | None, int, int]
"""(kind, partner kind or None for alone, sm level index, memory level index)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LearnConfig:
    """The rule that moves an entry of the grid (module docstring)."""

    min_samples: int = 5
    """Observations an entry needs before it moves at all; with fewer it stays at its base value."""
    window: int = 32
    """Most recent log-ratios kept per entry: the estimate is their median (an outlier or two
    of a window moves nothing), and the bound on memory."""
    prior_sd_log: float = 0.25
    """How far (natural log) the base grid is believed to be off: the spread of the shrinkage
    prior, so a correction is median · τ² / (τ² + spread² / n)."""
    spread_floor_log: float = 0.02
    """Least spread (natural log) an entry is credited with: measurements are never exact."""
    min_factor: float = 0.5
    """The learned value is at least this times the base value."""
    max_factor: float = 2.0
    """The learned value is at most this times the base value."""
    min_share_frac: float = 0.6
    """Share of a grant's wall time one entry must hold for the grant to be evidence about it."""
    pool_memory_levels: bool = True
    """An entry with fewer than `min_samples` of its own takes the pooled correction of its
    memory levels (same kind, partner and SM level) once they have `min_samples` together:
    the SM share sets a slowdown, the memory level mostly whether it fits (the priors have
    one value across a row's feasible levels), so evidence at one level speaks for its row.
    An entry's own samples, once it has enough, override the row's."""
    republish_log: float = 0.01
    """Smallest change (natural log) of a correction that rebuilds the grid the scheduler plans
    with: a rebuild re-indexes every table."""
    max_unsettled_frac: float = 0.15
    """Share of a grant's wall time its other entries may hold while not settled (priced at
    their current values): a grant re-granted at a new point a moment after it started, or whose
    partner left for a moment, still counts; above it, the grant is not evidence."""
    frozen: bool = False
    """Record every sample but move no entry: the grid's error is measured (a finished grant's
    `Learned.error_log`), the scheduler plans with the base grid (`jigsaw daemon --watch-grid`)."""
    probes_per_kind: int = 8
    """Grants of one kind a pipeline runs with nothing beside it, while it has no rate of that
    kind alone and no other reference (node/learning.py): what its co-located grants are then
    measured against.  At least min_samples to learn anything; a few more for probes a partner's
    urgent piece joined.  0: no probes (only grants that happen to run alone are references)."""

    def __post_init__(self) -> None:
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ValueError(f"need 1 <= min_samples <= window, got {self.min_samples}, {self.window}")
        if not 0.0 < self.min_factor <= 1.0 <= self.max_factor:
            raise ValueError(f"need 0 < min_factor <= 1 <= max_factor, got {self.min_factor}, {self.max_factor}")
        if not 0.0 <= self.max_unsettled_frac <= 1.0 - self.min_share_frac:
            raise ValueError(f"max_unsettled_frac must be in [0, 1 - min_share_frac], got {self.max_unsettled_frac}")
        if self.probes_per_kind < 0:
            raise ValueError(f"probes_per_kind must be >= 0, got {self.probes_per_kind}")
        if not 0.5 <= self.min_share_frac <= 1.0:
            # below half, two entries could both claim one grant
            raise ValueError(f"min_share_frac must be in [0.5, 1], got {self.min_share_frac}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """A part of a grant's life at one grid point."""

    entry: Entry | None
    """Where it ran; None: nowhere the grid can learn (off the levels, or a gang replica paced
    by another replica)."""
    wall_s: float
    slowdown: float
    """The slowdown the plan predicted there."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EntryReport:
    """One entry as `jigsaw inspect` shows it."""

    entry: Entry
    sm_frac: float
    mem_frac: float
    prior: float
    learned: float
    count: int
    spread_log: float


class LearnedFileError(ValueError):
    """A learned-grid file that cannot be used; says which file and what."""

    def __init__(self, path: str, problem: str):
        self.path, self.problem = path, problem
        super().__init__(f"{path}: {problem}")


class _Stats:
    __slots__ = ("count", "window")

    def __init__(self, window: int):
        self.count = 0
        self.window: deque[float] = deque(maxlen=window)

    def add(self, x: float) -> None:
        self.count += 1
        self.window.append(x)

    def spread(self, floor: float) -> float:
        return _spread(self.window, floor)


def _spread(xs, floor: float) -> float:
    """The samples' spread: their median absolute deviation as a standard deviation, at least `floor`."""
    if len(xs) < 2:
        return floor
    m = statistics.median(xs)
    return max(floor, MAD_TO_SD * statistics.median(abs(x - m) for x in xs))


class GridLearner:
    """Per-entry evidence over a base grid, and the refined grid it implies (module docstring)."""

    def __init__(self, base: SlowdownGrid, config: LearnConfig = LearnConfig()):
        self.base, self.config = base, config
        self._tables = base.to_dict()
        self._stats: dict[Entry, _Stats] = {}
        self._published: dict[Entry, float] = {}
        self._grid = base
        self.observed = 0
        """Grants that were evidence about an entry."""
        self.skipped: Counter[str] = Counter()
        """Grants that were not, by why."""

    # ------------------------------------------------------------ values

    def base_value(self, entry: Entry) -> float | None:
        """The base grid's number at `entry`; None where it is null (infeasible)."""
        kind, partner, i, j = entry
        table = self._tables["alone"][kind] if partner is None else self._tables["pairs"][kind][partner]
        return table[i][j]

    def movable(self, entry: Entry) -> bool:
        """Not the normalisation point (alone, every SM, top memory level: 1.0 by definition)."""
        kind, partner, i, j = entry
        top = (len(self.base.sm_levels) - 1, len(self.base.mem_levels) - 1)
        return partner is not None or (i, j) != top

    def settled(self, entry: Entry | None) -> bool:
        """Its value is known as well as the rule allows: min_samples (its own, or its row's
        with pool_memory_levels), or the normalisation point."""
        if entry is None:  # off the grid, or paced by another replica: its slowdown is unknown
            return False
        return not self.movable(entry) or self._evidence(entry) is not None

    def correction(self, entry: Entry) -> float:
        """log(learned / base) by the rule (LearnConfig); 0 until the entry (or its row) has
        min_samples."""
        xs, c = self._evidence(entry), self.config
        if c.frozen or xs is None or not self.movable(entry):
            return 0.0
        se2 = _spread(xs, c.spread_floor_log) ** 2 / len(xs)
        tau2 = c.prior_sd_log ** 2
        return min(max(statistics.median(xs) * tau2 / (tau2 + se2), math.log(c.min_factor)), math.log(c.max_factor))

    def _evidence(self, entry: Entry) -> list[float] | None:
        """The samples `entry`'s value comes from: its own with min_samples, else its row's
        pooled (pool_memory_levels) with min_samples together, else None."""
        st, c = self._stats.get(entry), self.config
        if st is not None and st.count >= c.min_samples:
            return list(st.window)
        if not c.pool_memory_levels:
            return None
        kind, partner, i, _ = entry
        row = [self._stats.get((kind, partner, i, j)) for j in range(len(self.base.mem_levels))]
        if sum(r.count for r in row if r is not None) < c.min_samples:
            return None
        return [x for r in row if r is not None for x in r.window]

    def _rows(self) -> set[Entry]:
        """Every entry evidence speaks for: those with samples, and their rows' feasible levels."""
        out = set(self._stats)
        if self.config.pool_memory_levels:
            out |= {(k, p, i, j) for (k, p, i, _) in self._stats for j in range(len(self.base.mem_levels))
                    if self.base_value((k, p, i, j)) is not None}
        return out

    def value(self, entry: Entry) -> float:
        """The current estimate at `entry` (base × e^correction); inf where the base is null."""
        b = self.base_value(entry)
        return math.inf if b is None else max(NOISE_FLOOR, b * math.exp(self.correction(entry)))

    # ------------------------------------------------------------ evidence

    def record(self, entry: Entry, log_ratio: float) -> None:
        """One sample of log(true / base) at `entry`."""
        if not math.isfinite(log_ratio):
            raise ValueError(f"log ratio must be finite, got {log_ratio!r}")
        st = self._stats.get(entry)
        if st is None:
            st = self._stats[entry] = _Stats(self.config.window)
        st.add(min(max(log_ratio, -MAX_ABS_LOG), MAX_ABS_LOG))

    def observe(self, segments: Sequence[Segment], reference_s: float, *, exact: Entry | None = None) -> Entry | None:
        """A finished grant: its segments and its exclusive seconds; the entry it was evidence
        about, or None (why: `skipped`).  `exact`: the point the reference was measured at (its
        segments there are priced by the reference itself: settled)."""
        why, entry, s = self._attribute(segments, reference_s, exact)
        if why:
            self.skipped[why] += 1
            return None
        self.record(entry, math.log(s / self.base_value(entry)))
        self.observed += 1
        return entry

    def _attribute(self, segments: Sequence[Segment], reference_s: float, exact: Entry | None = None):
        wall: dict[Entry | None, float] = {}
        for seg in segments:
            if seg.wall_s > 0.0:
                wall[seg.entry] = wall.get(seg.entry, 0.0) + seg.wall_s
        total = sum(wall.values())
        if total <= 0.0 or not reference_s > 0.0:
            return "empty", None, 0.0
        k = max(wall, key=wall.get)
        if k is None:
            return "off-grid", None, 0.0
        if wall[k] < self.config.min_share_frac * total:
            return "mixed", None, 0.0
        if not self.movable(k):
            return "normalisation", None, 0.0
        if self.base_value(k) is None:
            return "infeasible", None, 0.0
        others = [e for e in wall if e != k]
        unsettled = sum(wall[e] for e in others if e != exact and not self.settled(e))
        if unsettled > self.config.max_unsettled_frac * total:  # their prior values may be what is wrong
            return "mixed with unsettled", None, 0.0
        if any(e is None for e in others):
            return "mixed with off-grid", None, 0.0
        others_work = sum(wall[e] / self.value(e) for e in others)
        left = reference_s - others_work
        if left <= 0.05 * reference_s:  # the rest alone would have done it all: the numbers disagree
            return "inconsistent", None, 0.0
        return "", k, wall[k] / left

    # ------------------------------------------------------------ the refined grid

    def refined(self) -> SlowdownGrid:
        """The grid to plan with: rebuilt only when a correction moved by republish_log."""
        now = {e: self.correction(e) for e in self._rows()}
        now = {e: c for e, c in now.items() if c != 0.0}
        moved = set(now) ^ set(self._published) or {
            e for e, c in now.items() if abs(c - self._published[e]) > self.config.republish_log}
        if moved:
            self._published = now
            self._grid = self._build(now)
        return self._grid

    def _build(self, corrections: Mapping[Entry, float]) -> SlowdownGrid:
        if not corrections:
            return self.base
        data = copy.deepcopy(self._tables)
        for (kind, partner, i, j), c in corrections.items():
            table = data["alone"][kind] if partner is None else data["pairs"][kind][partner]
            table[i][j] = max(NOISE_FLOOR, table[i][j] * math.exp(c))
        data["source"]["note"] = (f"{data['source']['note']} | refined online from {self.observed} grants, "
                                  f"{len(corrections)} entries moved (jigsaw.mux.model.learned)")
        return SlowdownGrid.from_dict(data, path=f"<learned over {self.base.path or self.base.model}>")

    def report(self) -> list[EntryReport]:
        """Every entry with evidence (its own, or its row's: count 0): prior, learned value,
        its own count and the spread of the samples its value comes from."""
        out = []
        for e in sorted(self._rows(), key=lambda x: (x[0], x[1] or "", x[2], x[3])):
            st, xs = self._stats.get(e), self._evidence(e) or []
            out.append(EntryReport(entry=e, sm_frac=self.base.sm_levels[e[2]], mem_frac=self.base.mem_levels[e[3]],
                                   prior=self.base_value(e), learned=self.value(e), count=st.count if st else 0,
                                   spread_log=_spread(xs or (st.window if st else ()), self.config.spread_floor_log)))
        return out

    # ------------------------------------------------------------ files

    def to_dict(self) -> dict:
        b = self.base
        return {"format": FORMAT, "version": VERSION, "device": b.device.sku, "model": b.model,
                "base": {"source": b.source, "sha256": _digest(b)}, "config": asdict(self.config),
                "entries": [{"kind": k, "partner": p, "sm_frac": b.sm_levels[i], "mem_frac": b.mem_levels[j],
                             "base": self.base_value((k, p, i, j)), "count": st.count, "log_ratios": list(st.window)}
                            for (k, p, i, j), st in self._stats.items()]}

    def save(self, path: str | os.PathLike) -> None:
        """Written whole to a temporary file, then renamed: a crash never leaves half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike, base: SlowdownGrid, config: LearnConfig = LearnConfig()) -> GridLearner:
        """The learner a file holds, over `base`; LearnedFileError naming the file otherwise.
        Samples were taken against the file's base values: over a different base (a grid
        measured since), each is re-expressed against the new one."""
        p = os.fspath(path)
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise LearnedFileError(p, f"cannot read it as JSON: {e}") from e
        learner = cls(base, config)
        _Reader(p, learner).read(data)
        return learner


class _Reader:
    """Validates a parsed learned file into a learner; each fault is one LearnedFileError."""

    def __init__(self, path: str, learner: GridLearner):
        self.path, self.learner = path, learner

    def fail(self, problem: str) -> LearnedFileError:
        return LearnedFileError(self.path, problem)

    def read(self, data: Any) -> None:
        b = self.learner.base
        if not isinstance(data, Mapping) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise self.fail(f"not a {FORMAT} v{VERSION} file")
        if (data.get("device"), data.get("model")) != (b.device.sku, b.model):
            raise self.fail(f"learned for {data.get('model')!r} on {data.get('device')!r}, not {b.model!r} on "
                            f"{b.device.sku!r}")
        entries = data.get("entries")
        if not isinstance(entries, list):
            raise self.fail("entries: expected a list")
        for n, raw in enumerate(entries):
            self.entry(n, raw)

    def entry(self, n: int, raw: Any) -> None:
        b, where = self.learner.base, f"entries[{n}]"
        if not isinstance(raw, Mapping):
            raise self.fail(f"{where}: expected an object")
        kind, partner = raw.get("kind"), raw.get("partner")
        if kind not in b.kinds or (partner is not None and partner not in b.kinds):
            raise self.fail(f"{where}: kinds {kind!r}, {partner!r} are not the grid's {list(b.kinds)}")
        i, j = _index(b.sm_levels, raw.get("sm_frac")), _index(b.mem_levels, raw.get("mem_frac"))
        if i is None or j is None:
            raise self.fail(f"{where}: sm_frac {raw.get('sm_frac')!r} / mem_frac {raw.get('mem_frac')!r} are not "
                            "levels of the grid")
        count, xs, old = raw.get("count"), raw.get("log_ratios"), raw.get("base")
        if not isinstance(count, int) or isinstance(count, bool) or not isinstance(xs, list) \
                or not 0 < len(xs) <= count or not all(_finite(x) for x in xs):
            raise self.fail(f"{where}: needs a count >= 1 and 1..count finite log_ratios")
        entry = (kind, partner, i, j)
        new = self.learner.base_value(entry)
        if new is None or not _finite(old) or old <= 0:
            raise self.fail(f"{where}: no base value to learn against (null in the grid, or {old!r} in the file)")
        shift = math.log(old / new)  # samples were log(true / old base)
        for x in xs[-self.learner.config.window:]:
            self.learner.record(entry, x + shift)
        self.learner._stats[entry].count = count


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _index(levels: tuple[float, ...], x: Any) -> int | None:
    if not _finite(x):
        return None
    return next((i for i, level in enumerate(levels) if abs(level - x) <= 1e-9), None)


def _digest(grid: SlowdownGrid) -> str:
    return hashlib.sha256(json.dumps(grid.to_dict(), sort_keys=True).encode()).hexdigest()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def learned_path(grid: SlowdownGrid, node: str | None = None, root: str | os.PathLike | None = None) -> Path:
    """Where a node's learned grid over `grid` lives: <root>/learned/<node>/<sku>/<model>.json,
    root the user's profile directory (jigsaw.profiles.user_dir), node this host's name.
    Three levels down, so it is never taken for a grid name (profiles.available)."""
    from jigsaw.profiles import user_dir

    base = Path(root) if root is not None else user_dir()
    return base / "learned" / _safe(node or socket.gethostname()) / _safe(grid.device.sku) / f"{_safe(grid.model)}.json"


def load_or_fresh(path: str | os.PathLike, base: SlowdownGrid,
                  config: LearnConfig = LearnConfig()) -> tuple[GridLearner, str]:
    """The learner saved at `path`, else a fresh one over `base`, and what to tell the user
    ("" when all went well).  A file that cannot be used is moved aside to .rejected.json (a
    later save would destroy the evidence) and the node starts from the base grid."""
    if not Path(path).is_file():
        return GridLearner(base, config), ""
    try:
        return GridLearner.load(path, base, config), ""
    except LearnedFileError as e:
        aside = Path(path).with_suffix(".rejected.json")
        try:
            os.replace(path, aside)
            kept = f"moved to {aside}"
        except OSError as err:
            kept = f"could not be moved aside ({err})"
        return GridLearner(base, config), f"{e}; learning starts again from the base grid (the file {kept})"


def scaled(grid: SlowdownGrid, factors: Mapping[tuple[str, str | None], float], note: str = "") -> SlowdownGrid:
    """`grid` with every feasible value of (kind, partner) tables times its factor (partner
    None: the kind alone, its normalisation point kept): a known true grid for a simulation."""
    data = grid.to_dict()
    for (kind, partner), f in factors.items():
        if kind not in grid.kinds or (partner is not None and partner not in grid.kinds) or not f > 0:
            raise ValueError(f"cannot scale {kind}/{partner} by {f!r}: kinds are {list(grid.kinds)}")
        table = data["alone"][kind] if partner is None else data["pairs"][kind][partner]
        top = (len(table) - 1, len(table[0]) - 1)
        for i, row in enumerate(table):
            for j, v in enumerate(row):
                if v is not None and (partner is not None or (i, j) != top):
                    row[j] = max(NOISE_FLOOR, v * f)
    data["source"]["note"] = note or f"{data['source']['note']} | scaled {dict(factors)}"
    return SlowdownGrid.from_dict(data)


def parse_scale(items: Sequence[str]) -> dict[tuple[str, str | None], float]:
    """KIND/PARTNER=FACTOR items (PARTNER `alone`: the kind alone) as `scaled`'s factors."""
    out = {}
    for item in items:
        m = re.fullmatch(r"([\w-]+)/([\w-]+)=([0-9.]+)", item.strip())
        if m is None:
            raise ValueError(f"expected KIND/PARTNER=FACTOR (PARTNER 'alone' for alone), got {item!r}")
        kind, partner, f = m.groups()
        out[(kind, None if partner == "alone" else partner)] = float(f)
    return out
