"""SM partitions of one GPU with CUDA green contexts (the device side of an SM budget σ).

    probe(device) ─► GreenSupport: driver version, compute capability, SM resource, backend
         │                         ("torch" | "cuda-python", picked at run time)
    split_sms(resource, σ) ─► (SMs for σ, SMs for 1-σ)     pure: granularity table + rounding
         │
    GreenPartitions(device, fracs): ONE split per budget pair {σ, 1-σ} ─► two green contexts,
         │   one non-blocking stream each (torch.cuda.ExternalStream)
         ├─ pair(σ) ─► (Partition σ, Partition 1-σ)   pair(1-σ) is the same two, swapped
         └─ full    ─► Partition 1.0 on an ordinary stream (the whole device)
    GreenPartitioner.apply(device, {substage: σ}) ─► {substage: {kind, num_sms, budget, side}}

Disjointness comes from the split, not from the counts: results of ONE split are disjoint,
results of two splits of the device may overlap (torch 2.15 `SMPartition.split` docstring).
So both sides of a pair come from one split, and σ and 1-σ share that split: whichever two
budgets the scheduler co-locates, (σ, 1-σ), run on disjoint SMs.

The backends only supply primitives (split the device into two SM resources, open a context
plus stream on one, close it); rounding, pairing, bookkeeping and error mapping live here
once.  Nothing imports torch or cuda-python at module level, and driver entry points are
resolved when called, so importing this module never touches a driver that lacks green
contexts (sglang#8432: "undefined symbol: cuGreenCtxDestroy" on driver 535).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

log = logging.getLogger("jigsaw.green")

GREEN_CTX_MIN_DRIVER = 12040
"""cuGreenCtxCreate and cuDevSmResourceSplitByCount appear in CUDA 12.4 (driver R550)."""
GREEN_STREAM_MIN_DRIVER = 12050
"""cuGreenCtxStreamCreate appears in 12.5; on 12.4 the stream is made inside the context."""
STRUCTURED_SPLIT_MIN_DRIVER = 13010
"""cuDevSmResourceSplit (several exact groups from one split) appears in CUDA 13.1."""
TORCH_BACKEND_MIN_DRIVER = max(12080, STRUCTURED_SPLIT_MIN_DRIVER)
"""torch.cuda.green_contexts refuses drivers below 12.8; its SMPartition.split needs 13.1."""
FRAC_TOL = 1e-9
"""Budgets within this of a level are that level (1 - 0.8 is 0.19999999999999996)."""

Cause = Literal["torch-no-cuda", "torch-cuda-unavailable", "no-cuda-python", "no-driver",
                "driver-too-old", "no-device", "bad-device", "unsupported-device",
                "insufficient-sms", "driver-error"]
Backend = Literal["torch", "cuda-python"]

# CUresult codes with a known meaning here; others are "driver-error".
_CODE_CAUSES: dict[int, Cause] = {
    100: "no-device",          # CUDA_ERROR_NO_DEVICE
    101: "bad-device",         # CUDA_ERROR_INVALID_DEVICE
    801: "unsupported-device",  # CUDA_ERROR_NOT_SUPPORTED
    914: "insufficient-sms",   # CUDA_ERROR_INVALID_RESOURCE_TYPE
    915: "insufficient-sms",   # CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION
}


class GreenContextError(RuntimeError):
    """Green-context partitions cannot be made here; `cause` names the failed precondition."""

    def __init__(self, message: str, *, cause: Cause = "driver-error"):
        super().__init__(message)
        self.cause: Cause = cause


# ---------------------------------------------------------------------------------------
# pure: granularity and rounding


@dataclass(frozen=True, kw_only=True, slots=True)
class SmResource:
    """The SMs of one device and the partition sizes its driver accepts."""

    num_sms: int
    """Streaming multiprocessors on the device."""
    min_partition_sms: int
    """Smallest green-context partition, in SMs."""
    alignment_sms: int
    """A partition's SM count must be a multiple of this."""

    def __post_init__(self) -> None:
        for name in ("num_sms", "min_partition_sms", "alignment_sms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SmResource.{name} must be a positive int, got {value!r}")

    @property
    def smallest_sms(self) -> int:
        """The smallest valid partition: min_partition_sms rounded up to the alignment."""
        return -(-self.min_partition_sms // self.alignment_sms) * self.alignment_sms


def granularity(compute_capability: tuple[int, int]) -> tuple[int, int]:
    """(min_partition_sms, alignment_sms) of cuDevSmResourceSplitByCount by compute capability.

        CC 6.x   (1, 1)      CC 8.x   (4, 2)
        CC 7.x   (2, 2)      CC 9.0+  (8, 8)   Hopper, Blackwell

    Driver docs 12.4 / 13.0; flashinfer `get_sm_count_constraint` and sglang pdmux hard-code
    the same table.  Drivers >= 13.0 also report both numbers, and `probe` prefers those.
    """
    major, minor = compute_capability
    if major < 6:
        raise ValueError(f"green contexts need compute capability >= 6.0, got {major}.{minor}")
    if major >= 9:
        return (8, 8)
    return {6: (1, 1), 7: (2, 2), 8: (4, 2)}[major]


def split_sms(resource: SmResource, frac: float) -> tuple[int, int]:
    """SMs for share `frac` and for its complement: two valid, disjoint partitions.

    Rounding rule (mirror-symmetric: split_sms(r, 1-σ) is split_sms(r, σ) swapped):
      1. the smaller share s = min(σ, 1-σ) gets the valid count nearest to s * num_sms that
         still leaves room for a valid complement; an exact tie takes the larger count (the
         smaller side loses a bigger fraction of its throughput per missing SM);
      2. the other share gets the largest valid count that fits in what is left;
      3. the leftover (num_sms minus both, always < alignment_sms) goes to neither side.
    At σ = 0.5 the requested side plays the smaller one.

        Hopper 132 SMs (8, 8):  0.25 -> (32, 96)  0.5 -> (64, 64)  0.75 -> (96, 32)  4 unused
        A100   108 SMs (4, 2):  0.25 -> (28, 80)  0.5 -> (54, 54)  0.75 -> (80, 28)
    """
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac < 1.0:
        raise ValueError(f"frac must be a number strictly between 0 and 1, got {frac!r}")
    n, step, lo = resource.num_sms, resource.alignment_sms, resource.smallest_sms
    if n - lo < lo:
        raise ValueError(
            f"a device with {n} SMs cannot hold two green-context partitions: each needs at "
            f"least {resource.min_partition_sms} SMs in multiples of {step} ({2 * lo} in all)")
    target = min(frac, 1.0 - frac) * n
    # NOTE: round() absorbs float noise (0.3 * 10 = 3.0000000000000004) so ties stay ties.
    small = min(range(lo, n - lo + 1, step), key=lambda c: (round(abs(c - target), 9), -c))
    other = (n - small) // step * step
    return (small, other) if frac <= 0.5 else (other, small)


def budget_grid(resource: SmResource, fracs: Sequence[float] = (0.25, 0.5, 0.75)) -> dict[float, tuple[int, int]]:
    """split_sms for each budget level: {σ: (SMs for σ, SMs for 1-σ)}."""
    return {frac: split_sms(resource, frac) for frac in fracs}


def _levels(fracs: Sequence[float]) -> tuple[float, ...]:
    """The budget levels `fracs` allow, closed under complement (σ held means 1-σ is too)."""
    out: list[float] = []
    for frac in fracs:
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac < 1.0:
            raise ValueError(f"partition budgets must lie strictly between 0 and 1, got {frac!r}")
        for level in (float(frac), round(1.0 - frac, 12)):
            if _match(level, out) is None:
                out.append(level)
    return tuple(sorted(out))


def _match(frac: float, levels: Sequence[float]) -> float | None:
    return next((level for level in levels if abs(level - frac) <= FRAC_TOL), None)


def _pair_key(level: float) -> float:
    """The split that serves `level`: σ and 1-σ share one, keyed by the smaller share."""
    return min(level, round(1.0 - level, 12))


# ---------------------------------------------------------------------------------------
# probing


@dataclass(frozen=True, kw_only=True, slots=True)
class GreenSupport:
    """What `probe` found: green contexts work on this device, and how they will be made."""

    backend: Backend
    """"torch" (torch.cuda.green_contexts with SMPartition.split) or "cuda-python"."""
    driver_version: int
    """cuDriverGetVersion, e.g. 12080 for CUDA 12.8."""
    device: int
    """CUDA device ordinal."""
    name: str
    """Device name as the driver reports it."""
    compute_capability: tuple[int, int]
    """(major, minor)."""
    resource: SmResource
    """The device's SMs and its partition granularity."""


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise GreenContextError("torch is not installed; green-context streams are torch CUDA "
                                "streams", cause="torch-no-cuda") from exc
    return torch


def _import_driver() -> Any:
    try:
        import cuda.bindings.driver as drv
    except ImportError as exc:
        raise GreenContextError("cuda-python (cuda.bindings >= 12.6) is not installed: "
                                "pip install cuda-python", cause="no-cuda-python") from exc
    return drv


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _check(ret: Any, what: str) -> Any:
    """Unwrap a cuda.bindings result tuple (CUresult, *values); a failure is a GreenContextError."""
    err, *values = ret if isinstance(ret, tuple) else (ret,)
    code = int(err)
    if code != 0:
        cause = _CODE_CAUSES.get(code, "driver-error")
        hint = ": not enough SMs for the requested partition" if cause == "insufficient-sms" else ""
        raise GreenContextError(f"{what} failed with {getattr(err, 'name', 'CUresult')} ({code}){hint}",
                                cause=cause)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def require_torch_cuda(device: int = 0) -> Any:
    """torch, when it can run CUDA work on `device`; else GreenContextError saying why."""
    torch = _import_torch()
    if torch.version.cuda is None:
        raise GreenContextError(f"torch {torch.__version__} was built without CUDA "
                                "(torch.version.cuda is None); install a CUDA build of torch",
                                cause="torch-no-cuda")
    if not torch.cuda.is_available():
        raise GreenContextError(f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use a GPU: "
                                "torch.cuda.is_available() is False (no NVIDIA driver, no device, or a "
                                "driver older than torch's CUDA)", cause="torch-cuda-unavailable")
    if not 0 <= device < torch.cuda.device_count():
        raise GreenContextError(f"device {device} does not exist: torch sees "
                                f"{torch.cuda.device_count()} CUDA device(s)", cause="bad-device")
    return torch


def _init_driver(drv: Any) -> int:
    """cuInit, then the driver version; raises if there is no usable driver."""
    try:
        _check(drv.cuInit(0), "cuInit")
    except GreenContextError:
        raise
    except (RuntimeError, OSError) as exc:  # NOTE: no libcuda raises DynamicLibNotFoundError
        raise GreenContextError(f"no NVIDIA driver: libcuda could not be loaded ({exc})",
                                cause="no-driver") from exc
    version = int(_check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
    if version < GREEN_CTX_MIN_DRIVER:
        raise GreenContextError(
            f"NVIDIA driver too old: it supports CUDA {_version(version)} ({version}); green contexts "
            f"need >= {_version(GREEN_CTX_MIN_DRIVER)} ({GREEN_CTX_MIN_DRIVER}), and "
            f"cuGreenCtxStreamCreate >= {_version(GREEN_STREAM_MIN_DRIVER)}", cause="driver-too-old")
    return version


def _sm_resource(sm: Any, cc: tuple[int, int]) -> SmResource:
    """The device's SM resource; the driver's own granularity (13.0+) wins over the table."""
    table_min, table_step = granularity(cc)
    if int(sm.smCount) < 1:
        raise GreenContextError("the device reports no SM resource", cause="unsupported-device")
    return SmResource(num_sms=int(sm.smCount),
                      min_partition_sms=int(getattr(sm, "minSmPartitionSize", 0) or table_min),
                      alignment_sms=int(getattr(sm, "smCoscheduledAlignment", 0) or table_step))


def _torch_backend_ok(torch: Any, drv: Any, version: int, resource: SmResource) -> bool:
    """torch.cuda.green_contexts can make DISJOINT pairs: only through SMPartition.split.

    NOTE: torch's older GreenContext.create(num_sms) splits the whole device for every
    context, so two such contexts overlap (aten CUDAGreenContext.cpp) -- unusable for pairs.
    The structured split only takes even counts, hence the alignment test.
    """
    gc = getattr(torch.cuda, "green_contexts", None)
    return (gc is not None and getattr(gc, "SUPPORTED", True) is not False
            and hasattr(getattr(gc, "SMPartition", None), "split")
            and version >= TORCH_BACKEND_MIN_DRIVER and hasattr(drv, "cuDevSmResourceSplit")
            and resource.alignment_sms % 2 == 0 and resource.min_partition_sms % 2 == 0)


def probe(device: int = 0) -> GreenSupport:
    """Check at run time that green contexts can partition `device`; pick the backend.

    Checks, in order: torch has CUDA, cuda-python imports, libcuda loads (cuInit), the driver
    is >= 12.4, the ordinal exists, compute capability >= 6.0 with an SM resource, and torch
    can use the device.  The first failure raises GreenContextError with its `cause`.
    """
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise GreenContextError(f"bad device index {device!r}: expected an int >= 0", cause="bad-device")
    torch = _import_torch()
    if torch.version.cuda is None:
        require_torch_cuda(device)  # raises the torch-no-cuda message
    drv = _import_driver()
    version = _init_driver(drv)
    count = int(_check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    if device >= count:
        raise GreenContextError(f"device {device} does not exist: the driver sees {count} device(s)",
                                cause="bad-device")
    dev = _check(drv.cuDeviceGet(device), "cuDeviceGet")
    attr = drv.CUdevice_attribute
    cc = (int(_check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc")),
          int(_check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc")))
    raw = _check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    if cc < (6, 0):
        raise GreenContextError(f"{name} (compute capability {cc[0]}.{cc[1]}) is not supported: green "
                                "contexts need compute capability >= 6.0", cause="unsupported-device")
    try:
        sm = _check(drv.cuDeviceGetDevResource(dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                    "cuDeviceGetDevResource(SM)")
    except GreenContextError as exc:
        raise GreenContextError(f"{name} has no SM resource to split ({exc})", cause="unsupported-device") from exc
    resource = _sm_resource(sm.sm, cc)
    require_torch_cuda(device)
    backend: Backend = "torch" if _torch_backend_ok(torch, drv, version, resource) else "cuda-python"
    return GreenSupport(backend=backend, driver_version=version, device=device, name=name,
                        compute_capability=cc, resource=resource)


# ---------------------------------------------------------------------------------------
# partitions


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """One side of a budget pair: its SMs and the stream whose work runs only on them."""

    frac: float
    """The SM budget this side serves (σ, 1-σ, or 1.0 for the whole device)."""
    num_sms: int
    """SMs the driver gave the context (the ordinary stream of `full`: all of them)."""
    stream: Any
    """torch.cuda.Stream (an ExternalStream for green sides); invalid after close()."""


class GreenPartitions:
    """Disjoint green-context pairs for the budget levels of one device, plus the whole device.

    Use as a context manager, or call close(): streams and contexts are destroyed there and
    every Partition's stream is invalid afterwards (close graphs that use them first).
    Not thread-safe; one per process and device (green contexts do not cross processes).
    """

    def __init__(self, device: int = 0, fracs: Sequence[float] = (0.25, 0.5, 0.75)):
        self._levels = _levels(fracs)
        self._support = probe(device)
        self._torch = _import_torch()
        self._backend = _make_backend(self._torch, self._support)
        self._sides: list = []
        self._pairs: dict[float, tuple[Partition, Partition]] = {}
        self._full: Partition | None = None
        self._closed = False
        try:
            self._open_all(device)
        except BaseException:
            with contextlib.suppress(GreenContextError):  # the first error is the one to report
                self.close()
            raise

    def _open_all(self, device: int) -> None:
        torch, n = self._torch, self._support.resource.num_sms
        with torch.cuda.device(device):
            torch.cuda.synchronize()  # primary context first: cuGreenCtxCreate advises it
            for key in sorted({_pair_key(level) for level in self._levels}):
                self._pairs[key] = self._open_pair(key)
            self._full = Partition(frac=1.0, num_sms=n, stream=torch.cuda.Stream(device=device))

    def _open_pair(self, frac: float) -> tuple[Partition, Partition]:
        resource = self._support.resource
        try:
            counts = split_sms(resource, frac)
        except ValueError as exc:
            raise GreenContextError(str(exc), cause="insufficient-sms") from exc
        resources = self._backend.split(counts)
        for res in resources:
            self._sides.append(self._backend.open(res))
        a, b = self._sides[-2:]
        if a.num_sms + b.num_sms > resource.num_sms or min(a.num_sms, b.num_sms) < 1:
            raise GreenContextError(f"split {counts} came back as {a.num_sms} + {b.num_sms} SMs of "
                                    f"{resource.num_sms}: not two disjoint partitions", cause="driver-error")
        if (a.num_sms, b.num_sms) != counts:
            log.info("budget %g: asked for %s SMs, the driver gave (%d, %d)", frac, counts, a.num_sms, b.num_sms)
        return (Partition(frac=frac, num_sms=a.num_sms, stream=a.stream),
                Partition(frac=round(1.0 - frac, 12), num_sms=b.num_sms, stream=b.stream))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fracs(self) -> tuple[float, ...]:
        """Budget levels held, closed under complement: (0.25,) holds 0.25 and 0.75."""
        return self._levels

    @property
    def support(self) -> GreenSupport:
        return self._support

    @property
    def full(self) -> Partition:
        """The whole device on an ordinary stream (budget 1.0)."""
        self._alive()
        if self._full is None:
            raise RuntimeError("GreenPartitions has no full-device partition (construction failed)")
        return self._full

    def pair(self, frac: float) -> tuple[Partition, Partition]:
        """(the σ side, the 1-σ side); pair(1-σ) is the same two partitions swapped."""
        self._alive()
        level = _match(frac, self._levels)
        if level is None:
            raise ValueError(f"no partition pair for budget {frac!r}; this device holds {self._levels}")
        first, second = self._pairs[_pair_key(level)]
        return (first, second) if level <= 0.5 + FRAC_TOL else (second, first)

    def by_budget(self) -> dict[float, Partition]:
        """{σ: pair(σ)[0]} for every level plus {1.0: full}; the 0.5 partner is pair(0.5)[1]."""
        return {level: self.pair(level)[0] for level in self._levels} | {1.0: self.full}

    def close(self) -> None:
        """Drain and destroy every stream and context (idempotent); raise the first failure."""
        if self._closed:
            return
        self._closed = True
        sides, self._sides, self._pairs, self._full = self._sides, [], {}, None
        from jigsaw.mux.green_backends import _run_all

        _run_all([functools.partial(self._backend.close, side) for side in reversed(sides)])

    def _alive(self) -> None:
        if self._closed:
            raise RuntimeError("GreenPartitions is closed")


def _make_backend(torch: Any, support: GreenSupport):
    from jigsaw.mux.green_backends import _DriverBackend, _TorchBackend

    if support.backend == "torch":
        return _TorchBackend(torch, support)
    return _DriverBackend(torch, _import_driver(), support)


# ---------------------------------------------------------------------------------------
# the daemon's Partitioner


def assign_sides(budgets: Mapping[str, float], levels: Sequence[float]) -> dict[str, tuple[float, int]]:
    """{substage: (budget level, side)} for one device's budgets; ValueError if not a layout.

    A layout is a pair (σ, 1-σ) of levels, one budget alone (1.0, or a level σ < 1: a task
    keeps its side when its partner ends first), or nothing; 0.0 is host work (level 0.0).
    `side` indexes pair(level): 0, except the second of two 0.5 budgets (by substage id).
    """
    on_device: list[tuple[float, str]] = []
    out: dict[str, tuple[float, int]] = {}
    for sid, frac in budgets.items():
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not -FRAC_TOL <= frac <= 1 + FRAC_TOL:
            raise ValueError(f"{sid}: SM budget must lie in [0, 1], got {frac!r}")
        if frac <= FRAC_TOL:
            out[sid] = (0.0, 0)
        else:
            on_device.append((float(frac), sid))
    on_device.sort()
    layout = ", ".join(f"{sid}={frac:g}" for frac, sid in on_device)
    if len(on_device) > 2 or (len(on_device) == 2 and abs(on_device[0][0] + on_device[1][0] - 1.0) > FRAC_TOL):
        raise ValueError(f"budgets {{{layout}}} are not a pair (σ, 1-σ) of the levels {tuple(levels)} or one "
                         "budget alone")
    sides = {}
    for frac, sid in on_device:
        level = 1.0 if frac >= 1.0 - FRAC_TOL and len(on_device) == 1 else _match(frac, levels)
        if level is None:
            raise ValueError(f"{sid}: budget {frac:g} (in {{{layout}}}) is not a level {tuple(levels)} "
                             "or 1.0 alone")
        sides[level] = sides.get(level, -1) + 1
        out[sid] = (level, sides[level])
    return out


class GreenPartitioner:
    """Partitioner (jigsaw.mux.partition) backed by GreenPartitions, one per device, made lazily.

    The descriptor says which partition a sub-stage binds to: `parts.pair(budget)[side]` of a
    GreenPartitions with the same levels ("kind" "green"), the whole device ("full") or none
    ("host"); `num_sms` is what the driver gave in this process.
    """

    def __init__(self, fracs: Sequence[float] = (0.25, 0.5, 0.75), *,
                 factory: Callable[[int, Sequence[float]], GreenPartitions] = GreenPartitions):
        self.levels = _levels(fracs)
        self._factory = factory
        self._parts: dict[int, GreenPartitions] = {}

    def apply(self, device: int, budgets: Mapping[str, float]) -> Mapping[str, dict[str, str]]:
        placed = assign_sides(budgets, self.levels)
        if all(level == 0.0 for level, _ in placed.values()):
            return {sid: _descriptor("host", 0, 0.0, 0) for sid in placed}
        parts = self._partitions(device)
        out = {}
        for sid, (level, side) in placed.items():
            if level == 0.0:
                out[sid] = _descriptor("host", 0, level, side)
            elif level == 1.0:
                out[sid] = _descriptor("full", parts.full.num_sms, level, side)
            else:
                out[sid] = _descriptor("green", parts.pair(level)[side].num_sms, level, side)
        return out

    def _partitions(self, device: int) -> GreenPartitions:
        if device not in self._parts:
            self._parts[device] = self._factory(device, self.levels)
        return self._parts[device]

    def close(self) -> None:
        parts, self._parts = self._parts, {}
        for p in parts.values():
            p.close()


def _descriptor(kind: str, num_sms: int, level: float, side: int) -> dict[str, str]:
    return {"kind": kind, "num_sms": str(num_sms), "budget": f"{level:g}", "side": str(side)}
