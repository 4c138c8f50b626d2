"""CPU partitions, the CPU analogue of green contexts: budgets → core sets and thread counts.

    Plan.assignments of one device ─► CpuPartitioner.apply(device, {substage: σ})
        device d owns cores[d·n/D : (d+1)·n/D]  (n usable cores, D devices)
        σ = 1.0 alone ─► all of them; a pair (σ, 1−σ) ─► split_cores(): disjoint sets,
        at least one core each; σ = 0 (host work) ─► nothing changes
        ─► {"kind": "cpu", "cores": "0,1", "threads": "2"}  (sent inside each Grant)
    worker, at a grant change ─► apply_slice(cores, threads): os.sched_setaffinity +
        torch.set_num_threads, in the process that runs the sub-stage

`cpu_levels(n)` are the SM levels a CPU grid can hold: the shares a core split can really
give (k/n), so the scheduler never plans a budget the machine cannot enforce.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_LEVELS = 3
"""Partition levels below 1.0 a grid carries (like 25/50/75% on a GPU)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuSlice:
    cores: tuple[int, ...]
    """CPU ids the sub-stage's process may run on."""
    num_threads: int
    """Intra-op threads (torch.set_num_threads): one per core."""

    def descriptor(self) -> dict[str, str]:
        return {"kind": "cpu", "cores": ",".join(map(str, self.cores)), "threads": str(self.num_threads)}

    @classmethod
    def parse(cls, d: Mapping[str, str]) -> CpuSlice:
        if d.get("kind") != "cpu":
            raise ValueError(f"not a CPU partition: {dict(d)}")
        cores = tuple(int(c) for c in d["cores"].split(",") if c)
        return cls(cores=cores, num_threads=int(d["threads"]))


def usable_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def cpu_levels(num_cores: int) -> tuple[float, ...]:
    """Shares a split of `num_cores` can give (k/n), at most MAX_LEVELS below 1.0, plus 1.0."""
    shares = sorted({round(k / num_cores, 4) for k in range(1, num_cores)})
    if len(shares) > MAX_LEVELS:  # keep the levels spread: first, middle, last
        shares = [shares[0], shares[len(shares) // 2], shares[-1]]
    return (*shares, 1.0)


def split_cores(cores: Sequence[int], frac: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Disjoint core sets for a share `frac` and its complement, one core at least each."""
    if not 0.0 < frac < 1.0:
        raise ValueError(f"a split share must be in (0, 1), got {frac}")
    if len(cores) < 2:
        raise ValueError(f"cannot split {len(cores)} core(s) into two partitions")
    k = min(max(round(frac * len(cores)), 1), len(cores) - 1)
    return tuple(cores[:k]), tuple(cores[k:])


class CpuPartitioner:
    """Partitioner (jigsaw.mux.partition) over this machine's cores, split evenly among devices."""

    def __init__(self, num_devices: int = 1, cores: Sequence[int] | None = None):
        cores = tuple(cores if cores is not None else usable_cores())
        if num_devices < 1 or len(cores) < num_devices:
            raise ValueError(f"{len(cores)} cores cannot make {num_devices} CPU devices")
        per = len(cores) // num_devices
        self.devices = [cores[d * per:(d + 1) * per] for d in range(num_devices)]

    def apply(self, device: int, budgets: Mapping[str, float]) -> dict[str, dict[str, str]]:
        cores = self.devices[device]
        on = sorted((sid for sid, f in budgets.items() if f > 0.0), key=lambda s: (-budgets[s], s))
        out = {sid: {"kind": "host"} for sid, f in budgets.items() if f <= 0.0}
        if len(on) == 1:
            share = budgets[on[0]]
            mine = cores if share >= 1.0 or len(cores) < 2 else split_cores(cores, share)[0]
            out[on[0]] = CpuSlice(cores=mine, num_threads=len(mine)).descriptor()
        elif len(on) == 2:
            a, b = on
            if len(cores) < 2 or budgets[a] >= 1.0:  # unpartitioned sharing: both see every core
                sides = (cores, cores)
            else:
                sides = split_cores(cores, budgets[a])
            for sid, mine in zip((a, b), sides):
                out[sid] = CpuSlice(cores=mine, num_threads=len(mine)).descriptor()
        elif on:
            raise ValueError(f"device {device} holds {len(on)} sub-stages; a CPU partition holds at most 2")
        return out


def apply_slice(s: CpuSlice, pid: int = 0) -> None:
    """Bind every thread of the calling process (or of `pid`) to the slice, and set the
    caller's torch thread count.  sched_setaffinity binds one thread, and OpenMP workers that
    already exist keep their old mask, so each thread of /proc/<pid>/task is bound."""
    pid = pid or os.getpid()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), s.cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    if pid == os.getpid():
        import torch

        torch.set_num_threads(max(1, s.num_threads))
