"""SM-id census: on which SMs did a stream's work actually run?

    jigsaw/csrc/smid.cu ──torch.utils.cpp_extension.load (first use; cached under
        $JIGSAW_CACHE_DIR or ~/.cache/jigsaw, then torch_ext/torch<ver>-cu<ver>/smid)
        ──► torch.ops.jigsaw_smid.record(out int32[num_blocks], spin_ns)   current stream
    sm_ids(num_blocks, spin_ns, stream)  ─► {%smid of every block}
    confinement(partitions, fracs)       ─► per budget pair of green partitions:
        both sides' grids launched back to back on their own streams (so they overlap),
        then each side's id count <= its num_sms, and the two id sets disjoint ─► ConfinementReport
    two_process_census(fracs)            ─► per budget pair, the same two checks across TWO processes
        (what two pipelines' workers hold when the daemon grants them the two sides of pair(σ)):
        spawn 2 workers, each its own GreenPartitions(device, fracs) and side k of pair(σ)
            ─► barrier ─► side 0 alone ─► barrier ─► side 1 alone ─► barrier ─► both at once (x repeats)
            ─► per run: host start/end (CLOCK_MONOTONIC, one clock for every process), CUDA-event time, ids
        ─► parent: ids as above (over every run), and serial_frac from the times: 0 when the two
           grids ran at once (MPS), 1 when one waited for the other (time-sliced contexts)

Each side's grid has blocks_per_sm x (SMs of the whole device) blocks, so a stream that is
not confined spreads over more SMs than its partition holds and the count check fails.
%smid numbers are physical and need not be contiguous (PTX ISA), so only counts and
overlaps are compared, never ranges.

Importing this module never imports torch.  Without CUDA (a CPU torch build, no driver, no
CUDA toolkit for the build) every entry point raises SmIdError with the reason.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Protocol

from jigsaw.mux.partition.smsplit import PARTITION_LEVELS

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "smid.cu"
OP_NAMESPACE = "jigsaw_smid"
DEFAULT_SPIN_NS = 50_000
"""Each block's busy wait: long enough that a wave of blocks is resident at once."""
BLOCKS_PER_SM = 4
"""Grid size per SM of the device in `confinement` (1024-thread blocks: <= 2 resident per SM)."""

_lock = threading.Lock()
_op = None


class SmIdError(RuntimeError):
    """The SM-id kernel cannot run here (no CUDA, no toolkit, build failed); the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("JIGSAW_CACHE_DIR") or Path.home() / ".cache" / "jigsaw")


def require_cuda(device: int | None = None):
    """torch, when it can run CUDA kernels on `device`; SmIdError naming the reason otherwise."""
    try:
        import torch
    except ImportError as exc:
        raise SmIdError(f"torch is not installed ({exc})") from None
    if torch.version.cuda is None:
        raise SmIdError(f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): "
                        "it cannot run CUDA kernels")
    if not torch.cuda.is_available():
        raise SmIdError(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device: "
                        "torch.cuda.is_available() is False (no GPU or no NVIDIA driver)")
    if device is not None and not 0 <= device < torch.cuda.device_count():
        raise SmIdError(f"no CUDA device {device} (this process sees {torch.cuda.device_count()})")
    return torch


def build_directory(torch) -> Path:
    """One build per torch and CUDA version: an extension built for another torch would not load."""
    return cache_dir() / "torch_ext" / f"torch{torch.__version__}-cu{torch.version.cuda}" / "smid"


def load_op():
    """torch.ops.jigsaw_smid.record, building jigsaw/csrc/smid.cu the first time (then cached)."""
    global _op
    torch = require_cuda()
    with _lock:
        if _op is None:
            _op = _build(torch)
    return _op


def _build(torch):
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise SmIdError("no CUDA toolkit found to build the SM-id kernel: put nvcc on PATH or set CUDA_HOME")
    if not SOURCE.is_file():
        raise SmIdError(f"kernel source missing: {SOURCE} (a broken install?)")
    build_dir = build_directory(torch)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        # is_python_module=False: the library registers a torch op (TORCH_LIBRARY), no pybind module.
        cpp_extension.load(name="jigsaw_smid", sources=[str(SOURCE)], build_directory=str(build_dir),
                           extra_cuda_cflags=["-O2"], is_python_module=False, verbose=False)
    except Exception as exc:  # ninja/nvcc/linker errors arrive as RuntimeError, OSError, CalledProcessError
        raise SmIdError(f"building {SOURCE.name} in {build_dir} failed: {exc}") from exc
    return getattr(torch.ops, OP_NAMESPACE).record


@dataclass(frozen=True, slots=True)
class Launch:
    """A census grid in flight on `stream`; `ids()` waits for it."""

    out: object  # torch.Tensor, int32, one entry per block
    stream: object  # torch.cuda.Stream

    def ids(self) -> set[int]:
        self.stream.synchronize()  # the kernel ran on `stream`, not on the current one
        values = self.out.cpu().tolist()
        missing = values.count(-1)
        if missing:
            raise SmIdError(f"{missing} of {len(values)} blocks wrote no SM id")
        return set(values)


def launch(num_blocks: int, spin_ns: int = DEFAULT_SPIN_NS, stream=None, *, device: int | None = None) -> Launch:
    """Start a census grid of `num_blocks` blocks on `stream` (default: the current stream)."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if spin_ns < 0:
        raise ValueError(f"spin_ns must be >= 0, got {spin_ns}")
    torch = require_cuda(device)
    op = load_op()
    if stream is None:
        stream = torch.cuda.current_stream(device)
    out = torch.full((num_blocks,), -1, dtype=torch.int32, device=stream.device)
    # Green-context streams are non-blocking: without this wait the kernel could run before the fill.
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        op(out, spin_ns)
    return Launch(out=out, stream=stream)


def sm_ids(num_blocks: int, spin_ns: int = DEFAULT_SPIN_NS, stream=None, *, device: int | None = None) -> set[int]:
    """The SM ids the blocks of one census grid ran on (launched on `stream`, default current)."""
    return launch(num_blocks, spin_ns, stream, device=device).ids()


# ------------------------------------------------------------------ confinement


@dataclass(frozen=True, slots=True)
class SideResult:
    frac: float
    num_sms: int
    sm_ids: frozenset[int]

    @property
    def within(self) -> bool:
        """No more distinct SMs than the partition holds."""
        return len(self.sm_ids) <= self.num_sms

    def describe(self) -> str:
        return f"{self.frac:g}: {len(self.sm_ids)} SM ids seen / {self.num_sms} SMs"


@dataclass(frozen=True, slots=True)
class BudgetResult:
    frac: float
    sides: tuple[SideResult, SideResult]

    @property
    def overlap(self) -> frozenset[int]:
        return self.sides[0].sm_ids & self.sides[1].sm_ids

    @property
    def ok(self) -> bool:
        return all(s.within and s.sm_ids for s in self.sides) and not self.overlap

    def describe(self) -> str:
        a, b = self.sides
        return (f"{'OK' if self.ok else 'FAIL'}  {a.describe()}, {b.describe()}, "
                f"{len(self.overlap)} shared")


@dataclass(frozen=True, slots=True)
class ConfinementReport:
    device_sms: int
    budgets: tuple[BudgetResult, ...]

    @property
    def ok(self) -> bool:
        return bool(self.budgets) and all(b.ok for b in self.budgets)


def confinement(partitions, fracs: Sequence[float] | None = None, *, spin_ns: int = DEFAULT_SPIN_NS,
                blocks_per_sm: int = BLOCKS_PER_SM) -> ConfinementReport:
    """Check each budget pair of `partitions` (a jigsaw.mux.partition.green.GreenPartitions, or anything
    whose `pair(frac)` returns two objects with frac, num_sms and a torch.cuda.Stream `stream`)."""
    torch = require_cuda()
    fracs = tuple(partitions.fracs if fracs is None else fracs)
    budgets, device_sms = [], 0
    for frac in fracs:
        pair = tuple(partitions.pair(frac))
        device = pair[0].stream.device
        device_sms = torch.cuda.get_device_properties(device).multi_processor_count
        num_blocks = blocks_per_sm * device_sms
        running = [launch(num_blocks, spin_ns, side.stream) for side in pair]  # both in flight together
        seen = [run.ids() for run in running]
        budgets.append(BudgetResult(frac=frac, sides=tuple(
            SideResult(frac=side.frac, num_sms=side.num_sms, sm_ids=frozenset(ids)) for side, ids in zip(pair, seen))))
    return ConfinementReport(device_sms=device_sms, budgets=tuple(budgets))


# ------------------------------------------------------------------ two processes


TWO_PROCESS_SPIN_NS = 2_000_000
"""Each block's busy wait in `two_process_census`: with a few waves per grid, a grid lasts several
ms, much longer than the skew between two processes leaving a barrier, so the grids of both
processes are in flight together whenever the GPU can run them at once."""
SERIAL_FRAC_CONCURRENT = 0.5
"""A serial_frac below this counts as the two grids running at the same time."""


class CensusError(RuntimeError):
    """A worker of `two_process_census` failed or did not answer; the message holds its traceback."""


class Census(Protocol):
    """What a `two_process_census` worker runs on: GreenCensus on a GPU, a fake elsewhere."""

    device_sms: int

    def num_sms(self, frac: float, side: int) -> int:
        """SMs of side `side` of pair(frac)."""
        ...

    def run(self, frac: float, side: int, num_blocks: int, spin_ns: int) -> tuple[set[int], float]:
        """One census grid on side `side` of pair(frac), waited for: (its SM ids, GPU seconds)."""
        ...

    def close(self) -> None: ...


class GreenCensus:
    """A worker's census on real green contexts: its own GreenPartitions and the SM-id kernel."""

    def __init__(self, device: int, fracs: Sequence[float]):
        from jigsaw.mux.partition.green import GreenPartitions

        self.torch = require_cuda(device)
        self.torch.cuda.set_device(device)
        load_op()  # built or loaded from the cache before anything is timed
        self.device_sms = self.torch.cuda.get_device_properties(device).multi_processor_count
        self.parts = GreenPartitions(device, fracs)

    def num_sms(self, frac: float, side: int) -> int:
        return self.parts.pair(frac)[side].num_sms

    def run(self, frac: float, side: int, num_blocks: int, spin_ns: int) -> tuple[set[int], float]:
        cuda, stream = self.torch.cuda, self.parts.pair(frac)[side].stream
        begin, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        begin.record(stream)
        running = launch(num_blocks, spin_ns, stream)
        end.record(stream)
        ids = running.ids()  # waits for the stream
        return ids, begin.elapsed_time(end) / 1e3

    def close(self) -> None:
        self.parts.close()


@dataclass(frozen=True, slots=True)
class TwoProcessBudget:
    """One budget pair checked across two processes: the SM ids and the timing of their grids."""

    census: BudgetResult
    """Side 0 as process 0 saw it, side 1 as process 1 did (ids of every run, warm-up included)."""
    alone_s: tuple[float, float]
    """Median host seconds of each side's grid while the other process waits."""
    together_s: float
    """Median host seconds from the first start to the last end, both grids launched at once."""
    gpu_alone_s: tuple[float, float]
    """Median CUDA-event seconds of each side's grid alone."""
    gpu_together_s: tuple[float, float]
    """Median CUDA-event seconds of each side's grid in the runs together."""

    @property
    def frac(self) -> float:
        return self.census.frac

    @property
    def ok(self) -> bool:
        """Each side within its SMs and the two disjoint (timing never fails a budget)."""
        return self.census.ok

    @property
    def serial_frac(self) -> float:
        """(together - longer alone) / shorter alone: ~0 when the grids ran at the same time,
        ~1 when one ran after the other (time-sliced contexts)."""
        return (self.together_s - max(self.alone_s)) / max(min(self.alone_s), 1e-9)

    @property
    def concurrent(self) -> bool:
        return self.serial_frac < SERIAL_FRAC_CONCURRENT

    def describe(self) -> str:
        a, b = (1e3 * s for s in self.alone_s)
        how = "at the same time" if self.concurrent else "one after the other"
        return (f"{self.census.describe()}; alone {a:.1f} + {b:.1f} ms, together {1e3 * self.together_s:.1f} ms: "
                f"{how} (serial {self.serial_frac:.2f})")


@dataclass(frozen=True, slots=True)
class TwoProcessReport:
    device_sms: int
    budgets: tuple[TwoProcessBudget, ...]

    @property
    def ok(self) -> bool:
        return bool(self.budgets) and all(b.ok for b in self.budgets)

    @property
    def concurrent(self) -> bool:
        return bool(self.budgets) and all(b.concurrent for b in self.budgets)


def two_process_census(fracs: Sequence[float] = PARTITION_LEVELS, device: int = 0, *,
                       census: Callable[[int, tuple[float, ...]], Census] = GreenCensus,
                       spin_ns: int = TWO_PROCESS_SPIN_NS, blocks_per_sm: int = BLOCKS_PER_SM, repeats: int = 3,
                       timeout_s: float = 120.0) -> TwoProcessReport:
    """Both sides of each pair(σ) from two processes (see the module docstring); CensusError if a
    worker fails or does not answer within `timeout_s`.  `census(device, fracs)` is built in each
    worker, so it must pickle (a class, or a functools.partial of one)."""
    fracs = tuple(fracs)
    if not fracs or repeats < 1:
        raise ValueError(f"two_process_census needs budgets and repeats >= 1, got {fracs}, {repeats}")
    ctx = mp.get_context("spawn")  # a forked child cannot use CUDA
    barrier = ctx.Barrier(2, timeout=timeout_s)
    readers, procs = [], []
    for rank in range(2):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_census_worker, name=f"jigsaw-census-{rank}", daemon=True,
                           args=(rank, census, device, fracs, (spin_ns, blocks_per_sm, repeats), barrier, writer))
        proc.start()
        writer.close()
        readers.append(reader)
        procs.append(proc)
    try:
        first, second = _gather(readers, procs, timeout_s)
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    budgets = tuple(judge_two_process(a, b) for a, b in zip(first["budgets"], second["budgets"], strict=True))
    return TwoProcessReport(device_sms=first["device_sms"], budgets=budgets)


def judge_two_process(first: dict, second: dict) -> TwoProcessBudget:
    """One budget from what process 0 (side 0 of pair(σ)) and process 1 (side 1) reported."""
    frac = first["frac"]
    if abs(second["frac"] - frac) > 1e-9:
        raise ValueError(f"the two processes reported different budgets: {frac} and {second['frac']}")
    sides = (SideResult(frac=frac, num_sms=first["num_sms"], sm_ids=frozenset(first["sm_ids"])),
             SideResult(frac=round(1.0 - frac, 12), num_sms=second["num_sms"], sm_ids=frozenset(second["sm_ids"])))
    together = [max(a[1], b[1]) - min(a[0], b[0]) for a, b in zip(first["together"], second["together"], strict=True)]
    return TwoProcessBudget(
        census=BudgetResult(frac=frac, sides=sides),
        alone_s=(_median(first["alone"], span=True), _median(second["alone"], span=True)),
        together_s=statistics.median(together),
        gpu_alone_s=(_median(first["alone"]), _median(second["alone"])),
        gpu_together_s=(_median(first["together"]), _median(second["together"])))


def _median(runs: list, *, span: bool = False) -> float:
    """Median of runs (start_s, end_s, gpu_s): host spans (end - start), or GPU seconds."""
    return statistics.median((end - start) if span else gpu for start, end, gpu in runs)


def _now_s() -> float:
    # CLOCK_MONOTONIC is one clock for every process of the machine: spans compare across the two.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _census_worker(rank: int, make: Callable[[int, tuple[float, ...]], Census], device: int,
                   fracs: tuple[float, ...], knobs: tuple[int, int, int], barrier, writer) -> None:
    """One process of `two_process_census`: side `rank` of every pair(σ); sends its runs or its traceback."""
    try:
        census = make(device, fracs)
        try:
            runs = _census_runs(census, rank, fracs, *knobs, barrier)
        finally:
            census.close()
        writer.send(("ok", runs))
    except BaseException:  # noqa: BLE001 - everything goes to the parent, which raises it
        barrier.abort()  # the other process stops waiting for this one
        writer.send(("error", traceback.format_exc()))


def _census_runs(census: Census, rank: int, fracs: tuple[float, ...], spin_ns: int, blocks_per_sm: int,
                 repeats: int, barrier) -> dict:
    num_blocks = blocks_per_sm * census.device_sms
    budgets = []
    for frac in fracs:
        ids = set(census.run(frac, rank, num_blocks, spin_ns)[0])  # warm-up: the stream's first launch, untimed
        runs: dict[str, list] = {"alone": [], "together": []}
        for _ in range(repeats):
            for phase, mine in (("alone", rank == 0), ("alone", rank == 1), ("together", True)):
                barrier.wait()  # each phase starts when both processes finished the last one
                if mine:
                    start = _now_s()
                    seen, gpu_s = census.run(frac, rank, num_blocks, spin_ns)
                    runs[phase].append((start, _now_s(), gpu_s))
                    ids |= seen
        barrier.wait()
        budgets.append({"frac": frac, "num_sms": census.num_sms(frac, rank), "sm_ids": sorted(ids), **runs})
    return {"device_sms": census.device_sms, "budgets": budgets}


def _gather(readers: list, procs: list, timeout_s: float) -> list[dict]:
    """Both workers' runs, in rank order; CensusError with every worker's error otherwise."""
    deadline = time.monotonic() + timeout_s
    replies: dict[int, tuple[str, object]] = {}
    while len(replies) < len(readers):
        waiting = [r for i, r in enumerate(readers) if i not in replies]
        ready = wait_any(waiting, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = ", ".join(str(readers.index(r)) for r in waiting)
            raise CensusError(f"two-process census: worker(s) {late} did not answer within {timeout_s:g}s")
        for reader in ready:
            i = readers.index(reader)
            try:
                replies[i] = reader.recv()
            except EOFError:
                procs[i].join(1)
                replies[i] = ("error", f"exited with code {procs[i].exitcode} without an answer")
    errors = [f"worker {i}: {body}" for i, (kind, body) in sorted(replies.items()) if kind != "ok"]
    if errors:
        raise CensusError("two-process census failed:\n" + "\n".join(errors))
    return [replies[i][1] for i in range(len(readers))]
