"""SM-id census: on which SMs did a stream's work actually run?

    jigsaw/csrc/smid.cu ──torch.utils.cpp_extension.load (first use; cached under
        $JIGSAW_CACHE_DIR or ~/.cache/jigsaw, then torch_ext/torch<ver>-cu<ver>/smid)
        ──► torch.ops.jigsaw_smid.record(out int32[num_blocks], spin_ns)   current stream
    sm_ids(num_blocks, spin_ns, stream)  ─► {%smid of every block}
    confinement(partitions, fracs)       ─► per budget pair of green partitions:
        both sides' grids launched back to back on their own streams (so they overlap),
        then each side's id count <= its num_sms, and the two id sets disjoint ─► ConfinementReport

Each side's grid has blocks_per_sm x (SMs of the whole device) blocks, so a stream that is
not confined spreads over more SMs than its partition holds and the count check fails.
%smid numbers are physical and need not be contiguous (PTX ISA), so only counts and
overlaps are compared, never ranges.

Importing this module never imports torch.  Without CUDA (a CPU torch build, no driver, no
CUDA toolkit for the build) every entry point raises SmIdError with the reason.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
