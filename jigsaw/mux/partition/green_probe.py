"""Can green contexts partition this device, and how: the run-time probe of green.py.

    probe_resource(device) ─► SmResource (the driver only: what the daemon asks, no torch)
    probe(device) ─► GreenSupport: driver version, compute capability, SM resource, backend
                                   ("torch" | "cuda-python", picked at run time)
    GreenContextError(cause)      every failed precondition, named by its Cause
    _check(ret, what)             a cuda.bindings result unwrapped, or its GreenContextError

Both green.py (GreenPartitions) and green_backends.py (the driver and torch primitives)
build on this module, so neither imports the other back.  Nothing imports torch or
cuda-python at module level, and driver entry points are resolved when called, so importing
this module never touches a driver that lacks green contexts (sglang#8432: "undefined
symbol: cuGreenCtxDestroy" on driver 535).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from jigsaw.mux.partition.smsplit import SmResource, granularity

log = logging.getLogger("jigsaw.green")

GREEN_CTX_MIN_DRIVER = 12040
"""cuGreenCtxCreate and cuDevSmResourceSplitByCount appear in CUDA 12.4 (driver R550)."""
GREEN_STREAM_MIN_DRIVER = 12050
"""cuGreenCtxStreamCreate appears in 12.5; on 12.4 the stream is made inside the context."""
STRUCTURED_SPLIT_MIN_DRIVER = 13010
"""cuDevSmResourceSplit (several exact groups from one split) appears in CUDA 13.1."""
TORCH_BACKEND_MIN_DRIVER = max(12080, STRUCTURED_SPLIT_MIN_DRIVER)
"""torch.cuda.green_contexts refuses drivers below 12.8; its SMPartition.split needs 13.1."""

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
    _check_index(device)
    torch = _import_torch()
    if torch.version.cuda is None:
        require_torch_cuda(device)  # raises the torch-no-cuda message
    drv, version, name, cc, resource = _driver_facts(device)
    require_torch_cuda(device)
    backend: Backend = "torch" if _torch_backend_ok(torch, drv, version, resource) else "cuda-python"
    return GreenSupport(backend=backend, driver_version=version, device=device, name=name,
                        compute_capability=cc, resource=resource)


def probe_resource(device: int = 0) -> SmResource:
    """The SMs of `device` and their partition granularity, from the driver alone: no torch,
    no context (what the daemon needs to compute partition descriptors)."""
    _check_index(device)
    from jigsaw.mux.partition import fake_gpu

    fake = fake_gpu.resource()  # a fake GPU, named as such, stands in where none is (CI, --dry-run)
    return fake if fake is not None else _driver_facts(device)[4]


def _check_index(device: object) -> None:
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise GreenContextError(f"bad device index {device!r}: expected an int >= 0", cause="bad-device")


def _driver_facts(device: int) -> tuple[Any, int, str, tuple[int, int], SmResource]:
    """(driver module, version, name, compute capability, SM resource) of `device`."""
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
    return drv, version, name, cc, _sm_resource(sm.sm, cc)
