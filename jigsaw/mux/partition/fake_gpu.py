"""A FAKE GPU, named as such: green partitions where no GPU is, for CI and `--dry-run`.

    JIGSAW_FAKE_GPU=<num_sms>  JIGSAW_FAKE_GPU_LOG=<file>   (in the daemon's and the workers' environment)
        green_probe.probe_resource ─► SmResource(num_sms, 8, 8)        the daemon's GreenPartitioner
        bind.Binder(Green) ─► FakeGreenPartitions(levels).pair(σ)[side] ─► a FakeStream
        bind.on_stream(FakeStream) ─► one JSON line per launch into the log:
            {"pid", "pipeline", "t_s" (time.monotonic), "budget", "side", "num_sms", "sm_ids": [first, last + 1],
             and what the launcher notes: "kv_tokens" (a rollout engine's KV limit), "work" ...}

Nothing runs on it: the work runs where it would have run anyway (the CPU), and the log says
under which partition each launch was made.  The SM ids are those a deterministic split
gives (side 0 of pair(σ) the first ids, side 1 the next ones), so two processes that open the
same split and take opposite sides hold disjoint ids, as on a GPU; taking the same side, or
another level's split, shows as overlapping ids in the log.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from jigsaw.mux.partition.smsplit import SmResource, budget_levels, match_level, pair_key, split_sms

ENV_SMS = "JIGSAW_FAKE_GPU"
ENV_LOG = "JIGSAW_FAKE_GPU_LOG"
GRANULARITY = (8, 8)
"""Hopper's (min partition SMs, alignment)."""


def resource() -> SmResource | None:
    """The fake device's SMs when JIGSAW_FAKE_GPU is set, else None (a real GPU, or none)."""
    raw = os.environ.get(ENV_SMS, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 2 * GRANULARITY[0]:
        raise ValueError(f"{ENV_SMS}={raw!r}: the fake GPU's SM count, an integer >= {2 * GRANULARITY[0]}")
    return hopper(int(raw))


def hopper(num_sms: int) -> SmResource:
    """A fake device of `num_sms` SMs with Hopper's partition granularity."""
    return SmResource(num_sms=num_sms, min_partition_sms=GRANULARITY[0], alignment_sms=GRANULARITY[1])


@dataclass(frozen=True, slots=True)
class FakeStream:
    """A side of a fake split: what a launch on it is recorded as."""

    budget: float
    side: int
    num_sms: int
    first_sm: int

    @contextlib.contextmanager
    def launching(self, **note) -> Iterator[None]:
        record({"pid": os.getpid(), "pipeline": os.environ.get("JIGSAW_PIPELINE", ""), "t_s": time.monotonic(),
                "budget": self.budget, "side": self.side,
                "num_sms": self.num_sms, "sm_ids": [self.first_sm, self.first_sm + self.num_sms], **note})
        yield


@dataclass(frozen=True, slots=True)
class FakeSide:
    """green.Partition's fields, on the fake device."""

    frac: float
    num_sms: int
    stream: FakeStream


class FakeGreenPartitions:
    """GreenPartitions' API (pair, full, by_budget, close, a context manager) over the fake device."""

    def __init__(self, levels: Sequence[float], res: SmResource | None = None):
        self.resource = res or resource()
        if self.resource is None:
            raise ValueError(f"no fake GPU: {ENV_SMS} is not set")
        self.fracs = budget_levels(levels)
        whole = self.resource.num_sms
        self.full = FakeSide(1.0, whole, FakeStream(1.0, 0, whole, 0))

    def pair(self, frac: float) -> tuple[FakeSide, FakeSide]:
        level = match_level(frac, self.fracs)
        if level is None:
            raise ValueError(f"no partition pair for budget {frac!r}; this device holds {self.fracs}")
        key = pair_key(level)
        n0, n1 = split_sms(self.resource, key)
        first = FakeSide(key, n0, FakeStream(key, 0, n0, 0))
        second = FakeSide(round(1.0 - key, 12), n1, FakeStream(round(1.0 - key, 12), 1, n1, n0))
        return (first, second) if level <= 0.5 else (second, first)

    def by_budget(self) -> dict[float, FakeSide]:
        return {level: self.pair(level)[0] for level in self.fracs} | {1.0: self.full}

    def close(self) -> None:
        pass

    def __enter__(self) -> FakeGreenPartitions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record(entry: dict) -> None:
    path = os.environ.get(ENV_LOG)
    if path:
        with open(path, "a") as f:  # one short line per write: appends of two processes do not interleave
            f.write(json.dumps(entry) + "\n")


def read_log(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


__all__ = ["ENV_LOG", "ENV_SMS", "FakeGreenPartitions", "FakeStream", "hopper", "read_log", "resource"]
