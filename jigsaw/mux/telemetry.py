"""NVML telemetry: what each GPU is doing, sampled into the jigsaw trace.

    pynvml.nvmlInit ─► per device d (a CUDA index, mapped through CUDA_VISIBLE_DEVICES):
        nvmlDeviceGetUtilizationRates(h).gpu / 100          ─► sm_util_frac
        nvmlDeviceGetMemoryInfo(h).used                     ─► mem_used_bytes
        nvmlDeviceGetComputeRunningProcesses(h)
          + nvmlDeviceGetMPSComputeRunningProcesses(h)      ─► processes {"pid": bytes | None}
    sample(devices)            ─► [DeviceSample]                          one shot
    Telemetry(sink, interval_s) ─► a thread; every interval_s, per device:
        TraceEvent(event="telemetry", pipeline="", device=d, t_s=clock(), data=DeviceSample.data())
        ─► sink: a jigsaw.trace.Trace (appended) or any callable taking the event

`sm_util_frac` is NVML's "GPU utilisation": the fraction of the last sample period in which
*some* kernel ran, not the fraction of SMs busy, so a kernel confined to a quarter of the
SMs still reads 1.0.  Under MPS, clients are listed by the MPS call (the plain call shows
the MPS server).  Process keys are strings because the trace is JSON; a value is None where
NVML cannot tell (no permission, some containers).

Without NVML (no driver: pynvml raises NVMLError_LibraryNotFound) every entry point raises
TelemetryError with the reason.  pynvml is imported inside functions only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Self

from jigsaw.trace import Trace, TraceEvent


class TelemetryError(RuntimeError):
    """NVML is missing or failed; the message says which and why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSample:
    device: int
    sm_util_frac: float
    mem_used_bytes: int
    mem_total_bytes: int
    processes: dict[str, int | None] = field(default_factory=dict)

    def data(self) -> dict:
        """The `telemetry` trace event's data (see jigsaw.trace)."""
        return {"sm_util_frac": self.sm_util_frac, "mem_used_bytes": self.mem_used_bytes,
                "mem_total_bytes": self.mem_total_bytes, "processes": dict(self.processes)}


@dataclass(frozen=True, kw_only=True, slots=True)
class NvmlDevice:
    device: int
    name: str
    mem_total_bytes: int
    compute_capability: tuple[int, int] | None


@dataclass(frozen=True, kw_only=True, slots=True)
class NvmlInfo:
    driver_version: str
    cuda_driver_version: int | None
    """Highest CUDA version the driver supports, e.g. 13000 for 13.0."""
    devices: tuple[NvmlDevice, ...]


# ------------------------------------------------------------------ NVML session


@contextmanager
def nvml() -> Iterator:
    """pynvml, initialised for the block (nvmlInit/nvmlShutdown are reference counted)."""
    pynvml = _import_pynvml()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        raise TelemetryError("NVML shared library (libnvidia-ml.so) not found: "
                             "no NVIDIA driver on this machine") from None
    except pynvml.NVMLError as exc:
        raise TelemetryError(f"nvmlInit failed: {exc}") from None
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _import_pynvml():
    try:
        import pynvml
    except ImportError as exc:
        raise TelemetryError(f"pynvml (nvidia-ml-py) is not installed ({exc})") from None
    return pynvml


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def visible_devices(pynvml) -> list[int]:
    """CUDA indices this process sees: CUDA_VISIBLE_DEVICES' length, else every NVML device."""
    entries = _visible_entries()
    return list(range(len(entries))) if entries is not None else list(range(pynvml.nvmlDeviceGetCount()))


def _visible_entries() -> list[str] | None:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [e.strip() for e in raw.split(",") if e.strip()]


def handle(pynvml, device: int):
    """NVML handle of CUDA device `device`.

    NVML counts physical devices; CUDA counts those in CUDA_VISIBLE_DEVICES (integers or
    GPU-UUIDs).  The mapping assumes CUDA_DEVICE_ORDER=PCI_BUS_ID (NVML's order) when the
    variable is unset on a node with mixed GPU models.
    """
    entries = _visible_entries()
    if entries is None:
        return pynvml.nvmlDeviceGetHandleByIndex(device)
    if not 0 <= device < len(entries):
        visible = os.environ["CUDA_VISIBLE_DEVICES"]
        raise TelemetryError(f"device {device} is not visible (CUDA_VISIBLE_DEVICES={visible})")
    entry = entries[device]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)


# ------------------------------------------------------------------ queries


def info() -> NvmlInfo:
    """Driver versions and every visible device's name, memory and compute capability."""
    with nvml() as pynvml:
        return NvmlInfo(driver_version=_text(pynvml.nvmlSystemGetDriverVersion()),
                        cuda_driver_version=_optional(pynvml, pynvml.nvmlSystemGetCudaDriverVersion),
                        devices=tuple(_describe(pynvml, d) for d in visible_devices(pynvml)))


def _describe(pynvml, device: int) -> NvmlDevice:
    h = handle(pynvml, device)
    cc = _optional(pynvml, pynvml.nvmlDeviceGetCudaComputeCapability, h)
    return NvmlDevice(device=device, name=_text(pynvml.nvmlDeviceGetName(h)),
                      mem_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                      compute_capability=tuple(cc) if cc is not None else None)


def _optional(pynvml, fn, *args):
    """fn(*args), or None where this driver/device does not support it."""
    try:
        return fn(*args)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None


def sample_device(pynvml, device: int) -> DeviceSample:
    h = handle(pynvml, device)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    return DeviceSample(device=device, sm_util_frac=pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
                        mem_used_bytes=int(mem.used), mem_total_bytes=int(mem.total),
                        processes=_processes(pynvml, h))


def _processes(pynvml, h) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetMPSComputeRunningProcesses):
        for p in _optional(pynvml, fn, h) or ():
            used = getattr(p, "usedGpuMemory", None)  # None: NVML_VALUE_NOT_AVAILABLE
            out[str(p.pid)] = None if used is None else int(used)
    return out


def sample(devices: Sequence[int] | None = None) -> list[DeviceSample]:
    """One sample of each device (default: every visible one)."""
    with nvml() as pynvml:
        return [sample_device(pynvml, d) for d in (visible_devices(pynvml) if devices is None else devices)]


# ------------------------------------------------------------------ the sampler


Sink = Trace | Callable[[TraceEvent], None]


class Telemetry:
    """Samples every `interval_s` on a daemon thread and hands `telemetry` events to `sink`.

    `clock` gives the events' t_s (pass the runtime daemon's `now` to share its time base);
    by default seconds since `start()`.  NVML errors at start raise TelemetryError at once;
    an error inside the thread stops sampling and is raised again by `stop()`.
    """

    def __init__(self, sink: Sink, *, devices: Sequence[int] | None = None, interval_s: float = 1.0,
                 clock: Callable[[], float] | None = None):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.emit = sink.add if isinstance(sink, Trace) else sink
        self.devices = None if devices is None else list(devices)
        self.interval_s = interval_s
        self.clock = clock
        self.error: BaseException | None = None
        self._pynvml = None
        self._session: ExitStack | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError("Telemetry already started")
        stack = ExitStack()
        pynvml = stack.enter_context(nvml())  # raises TelemetryError without NVML
        try:
            if self.devices is None:
                self.devices = visible_devices(pynvml)
        except BaseException:
            stack.close()
            raise
        self._pynvml, self._session = pynvml, stack
        if self.clock is None:
            t0 = time.monotonic()
            self.clock = lambda: time.monotonic() - t0
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="jigsaw-telemetry", daemon=True)
        self._thread.start()
        return self

    def sample_once(self) -> list[TraceEvent]:
        """Sample each device now and emit the events (also what the thread does)."""
        if self._pynvml is None:
            raise RuntimeError("Telemetry.sample_once needs start() first")
        t_s = self.clock()
        events = [TraceEvent(t_s=t_s, event="telemetry", pipeline="", device=s.device, data=s.data())
                  for s in (sample_device(self._pynvml, d) for d in self.devices)]
        for e in events:
            self.emit(e)
        return events

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as exc:  # keep the error for stop(); a dead GPU must not kill the host process
                self.error = exc
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._session.close()
        self._pynvml = None
        if self.error is not None:
            raise TelemetryError(f"telemetry sampling failed: {self.error}") from self.error

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
