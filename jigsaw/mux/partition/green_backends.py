"""The two green-context backends: the few primitives that differ (split, open, close).

    GreenPartitions (green.py) ─► backend.split((n_a, n_b)) ─► backend.open(resource) ─► _Side(num_sms, stream)
    _DriverBackend   cuda-python: cuDevSmResourceSplit(ByCount) → GenerateDesc → GreenCtxCreate → stream
    _TorchBackend    torch.cuda.green_contexts (SMPartition.split, torch ≥ 2.15)

Everything else (rounding, pairing, bookkeeping) lives once in green.py, the probe and the
error mapping in green_probe.py; this module imports only the latter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from jigsaw.mux.partition.green_probe import (
    GREEN_STREAM_MIN_DRIVER,
    STRUCTURED_SPLIT_MIN_DRIVER,
    Cause,
    GreenContextError,
    GreenSupport,
    _check,
    log,
)


@dataclass(kw_only=True, slots=True)
class _Side:
    """One opened green context: its SM count, its torch stream and the backend's handles."""

    num_sms: int
    stream: Any
    handle: Any


class _DriverBackend:
    """cuda-python: cuDevSmResourceSplit(ByCount) -> GenerateDesc -> GreenCtxCreate -> stream."""

    def __init__(self, torch: Any, drv: Any, support: GreenSupport):
        self.torch, self.drv, self.support = torch, drv, support
        self.dev = _check(drv.cuDeviceGet(support.device), "cuDeviceGet")
        self.sm_type = drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM

    def split(self, counts: tuple[int, int]) -> list[Any]:
        """Two disjoint SM resources from ONE split of the device."""
        drv = self.drv
        whole = _check(drv.cuDeviceGetDevResource(self.dev, self.sm_type), "cuDeviceGetDevResource")
        if (self.support.driver_version >= STRUCTURED_SPLIT_MIN_DRIVER and hasattr(drv, "cuDevSmResourceSplit")
                and all(c % 2 == 0 for c in counts)):
            params = []
            for count in counts:
                p = drv.CU_DEV_SM_RESOURCE_GROUP_PARAMS()
                p.smCount = count
                params.append(p)
            results, _leftover = _check(drv.cuDevSmResourceSplit(2, whole, 0, params), "cuDevSmResourceSplit")
            return list(results)[:2]
        # Before 13.1 a split makes equal groups, and its results cannot be split again without
        # a context: split off the smaller side; the remainder (leftover SMs included) is the other.
        small = 0 if counts[0] <= counts[1] else 1
        results, made, rest = _check(drv.cuDevSmResourceSplitByCount(1, whole, 0, counts[small]),
                                     "cuDevSmResourceSplitByCount")
        if int(made) < 1:
            raise GreenContextError(f"cuDevSmResourceSplitByCount made no group of {counts[small]} SMs",
                                    cause="insufficient-sms")
        return [results[0], rest] if small == 0 else [rest, results[0]]

    def open(self, resource: Any) -> _Side:
        drv = self.drv
        desc = _check(drv.cuDevResourceGenerateDesc([resource], 1), "cuDevResourceGenerateDesc")
        ctx = _check(drv.cuGreenCtxCreate(desc, self.dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                     "cuGreenCtxCreate")
        side = _Side(num_sms=0, stream=None, handle=[ctx, None])
        try:
            side.handle[1] = self._raw_stream(ctx)
            got = _check(drv.cuGreenCtxGetDevResource(ctx, self.sm_type), "cuGreenCtxGetDevResource")
            side.num_sms = int(got.sm.smCount)
            side.stream = self.torch.cuda.ExternalStream(int(side.handle[1]), device=self.support.device)
        except BaseException:
            with contextlib.suppress(GreenContextError):
                self.close(side)
            raise
        return side

    def _raw_stream(self, ctx: Any) -> Any:
        drv = self.drv
        # NOTE: every stream of a green context must be non-blocking (torch PR #185527 review).
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        if self.support.driver_version >= GREEN_STREAM_MIN_DRIVER:
            return _check(drv.cuGreenCtxStreamCreate(ctx, flags, 0), "cuGreenCtxStreamCreate")
        plain = _check(drv.cuCtxFromGreenCtx(ctx), "cuCtxFromGreenCtx")  # 12.4: stream made inside it
        _check(drv.cuCtxPushCurrent(plain), "cuCtxPushCurrent")
        try:
            return _check(drv.cuStreamCreate(flags), "cuStreamCreate")
        finally:
            _check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def close(self, side: _Side) -> None:
        """Drain and destroy the stream, then the context; every step is tried."""
        drv, (ctx, raw) = self.drv, side.handle
        steps: list[Callable[[], object]] = []
        if raw is not None:
            steps += [lambda: _check(drv.cuStreamSynchronize(raw), "cuStreamSynchronize"),
                      lambda: _check(drv.cuStreamDestroy(raw), "cuStreamDestroy")]
        steps.append(lambda: _check(drv.cuGreenCtxDestroy(ctx), "cuGreenCtxDestroy"))
        _run_all(steps)


class _TorchBackend:
    """torch.cuda.green_contexts >= 2.15: SMPartition.split, GreenContext(sm_partition=...)."""

    def __init__(self, torch: Any, support: GreenSupport):
        self.gc, self.device = torch.cuda.green_contexts, support.device

    def split(self, counts: tuple[int, int]) -> list[Any]:
        with _torch_errors("SMPartition.split"):
            parts, _leftover = self.gc.SMPartition.from_device(self.device).split(num_sms=tuple(counts))
        return list(parts)

    def open(self, resource: Any) -> _Side:
        with _torch_errors("GreenContext"):
            ctx = self.gc.GreenContext(sm_partition=resource)
            return _Side(num_sms=int(ctx.sm_count), stream=ctx.Stream(), handle=ctx)

    def close(self, side: _Side) -> None:
        # torch destroys a GreenContext's streams and context when it is collected; this
        # drops the last reference once the stream has drained.
        with _torch_errors("GreenContext stream synchronize"):
            side.stream.synchronize()
        side.handle = None


@contextlib.contextmanager
def _torch_errors(what: str) -> Iterator[None]:
    try:
        yield
    except GreenContextError:
        raise
    except RuntimeError as exc:
        cause: Cause = "insufficient-sms" if "RESOURCE" in str(exc) else "driver-error"
        raise GreenContextError(f"{what} failed: {exc}", cause=cause) from exc


def _run_all(steps: Sequence[Callable[[], object]]) -> None:
    """Run every step even if one fails (each raises GreenContextError); re-raise the first."""
    first: GreenContextError | None = None
    for step in steps:
        try:
            step()
        except GreenContextError as exc:
            log.warning("%s", exc)
            first = first or exc
    if first is not None:
        raise first
