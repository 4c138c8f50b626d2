"""Worker-side binding: the one place a process is put on its partition.

    Grant.partition ─► Binder.bind(partition, pids) ─► Binding
        None        exclusive (no daemon, or fell open): the whole machine again
        Advisory    nothing changes (budgets are advice)
        Cpu         every thread of every listed process (this one if none) on the cores
        Green       this process's GreenPartitions, opened once per device and levels:
                    pair(budget)[side], or the whole device ─► Binding.partition.stream; work
                    launched on that stream (and CUDA graphs captured for that budget,
                    cudagraphs.py, replayed by Binding.budget) runs on those SMs only
    on_stream(stream)     the body's kernels on a grant's green stream (ordered with the caller's)
    follow_threads(cap)   an engine's intra-op threads = the cores it may use (at most cap),
                          called before each forward or micro-batch: a bind from another
                          process changes a worker's cores, the worker follows at its next op

The client binds at admission and at every budget change its heartbeat brings, for the
processes it was told run the sub-stage; engines never pin themselves.  Green contexts
belong to one process, so a green binding only ever concerns the calling process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from jigsaw.mux.partition.partitioners import Advisory, Green, Partition

log = logging.getLogger("jigsaw.bind")


@dataclass(frozen=True, slots=True)
class Binding:
    """What a sub-stage runs on after a bind."""

    partition: Partition | None
    cores: tuple[int, ...] | None = None
    """CPU cores of the listed processes (None: not changed)."""
    green: Any = None
    """jigsaw.mux.partition.green.Partition (num_sms, stream) of a green binding."""

    @property
    def stream(self) -> Any:
        """The torch stream to launch on (green), or None (the current stream)."""
        return None if self.green is None else self.green.stream

    @property
    def budget(self) -> float:
        """The SM level the partition serves (1.0: the whole device)."""
        return self.partition.budget if isinstance(self.partition, Green) else 1.0


class Binder:
    """Binds processes to partitions; one per process (it owns the green contexts it opens)."""

    def __init__(self, device: int = 0):
        self.device = device
        self.machine = tuple(sorted(os.sched_getaffinity(0)))
        """The cores this process could use when the binder was made: an exclusive grant's."""
        self._green: dict[tuple[int, tuple[float, ...]], Any] = {}

    def bind(self, partition: Partition | None, pids: Sequence[int] = ()) -> Binding:
        if isinstance(partition, Advisory):
            return Binding(partition)
        if isinstance(partition, Green):
            return Binding(partition, green=self._green_side(partition))
        cores = self.machine if partition is None else tuple(partition.cores)
        targets = tuple(pids) or (os.getpid(),)
        for pid in targets:
            pin(pid, cores)
        if os.getpid() in targets:
            follow_threads()
        return Binding(partition, cores=cores)

    def _green_side(self, g: Green):
        from jigsaw.mux.partition import fake_gpu

        key = (self.device, tuple(g.levels))
        parts = self._green.get(key)
        if parts is None:
            if fake_gpu.resource() is not None:
                parts = self._green[key] = fake_gpu.FakeGreenPartitions(g.levels)
            else:
                from jigsaw.mux.partition.green import GreenPartitions

                parts = self._green[key] = GreenPartitions(self.device, g.levels)
        side = parts.full if g.budget >= 1.0 else parts.pair(g.budget)[g.side]
        if g.budget < 1.0 and side.num_sms != g.num_sms:
            log.warning("budget %g side %d: the daemon planned %d SMs, this driver gave %d", g.budget, g.side,
                        g.num_sms, side.num_sms)
        return side

    def close(self) -> None:
        parts, self._green = self._green, {}
        for p in parts.values():
            p.close()


@contextlib.contextmanager
def on_stream(stream: Any, **note: Any) -> Iterator[None]:
    """Launch the body's kernels on `stream`, a grant's (Binding.stream); None: the current stream.
    `note`: what a fake GPU's log keeps beside the launch (an engine's KV limit, say).

    The one place work is put on a green partition.  Green streams are non-blocking, so the
    stream first waits for the caller's current stream (inputs made there) and the current
    stream then waits for it (outputs read there): a forward or micro-batch is ordered with
    what the caller does before and after it, whichever side of which split it ran on.  A fake
    GPU's stream (fake_gpu.py) records the launch instead."""
    if stream is None:
        yield
        return
    launching = getattr(stream, "launching", None)
    if launching is not None:
        with launching(**note):
            yield
        return
    import torch

    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


def pin(pid: int, cores: Sequence[int], rounds: int = 5) -> None:
    """Every thread of process `pid` on `cores` (sched_setaffinity binds one thread, and
    threads that exist already keep their mask; threads started later inherit their creator's).
    A thread started while the others move, by one not moved yet, inherits the old mask: the
    threads are listed again until no new one appears (at most `rounds` times)."""
    done: set[str] = set()
    for _ in range(rounds):
        try:
            tids = set(os.listdir(f"/proc/{pid}/task")) - done
        except FileNotFoundError:
            return  # the process is gone
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:
                pass  # the thread ended meanwhile
        done |= tids


def follow_threads(cap: int | None = None) -> int:
    """Set this thread's torch intra-op threads to its allowed cores (at most `cap`); returns
    the count.  Does nothing before torch is imported (it is never imported here)."""
    n = len(os.sched_getaffinity(0))
    if cap is not None:
        n = min(n, max(1, cap))
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def affinity(pid: int) -> dict[int, tuple[int, ...]]:
    """{thread id: allowed cores} of every thread of `pid`, read from /proc (what really holds,
    whoever set it)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                line = next(ln for ln in f if ln.startswith("Cpus_allowed_list:"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        out[int(tid)] = _cpu_list(line.split(":", 1)[1].strip())
    return out


def _cpu_list(text: str) -> tuple[int, ...]:
    """'0-2,5' -> (0, 1, 2, 5)."""
    cores: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cores)


__all__ = ["Binder", "Binding", "affinity", "follow_threads", "on_stream", "pin"]
