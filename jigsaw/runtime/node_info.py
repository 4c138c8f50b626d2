"""What an on-demand daemon runs with on this node: devices, slowdown grid, partitioner.

    probe()  ─► Probe: GPU names from NVML (pynvml, imported only here; no driver or no [gpu] extra: none),
                       this process's cores, the MPS daemon's state (on a GPU node)
    choose(probe, model) ─► Choice   (pure: a test feeds it "2 × NVIDIA H100 80GB HBM3")
        no GPU      ─► 1 device, grid cpu/tiny-qwen3 (the user's measured one shadows the
                       shipped one by name), partitioner cpu over this process's cores
        H100 / A100 ─► one device per GPU, the <sku>/<model> prior, partitioner advisory
        another SKU ─► the same with the h100 prior, and a warning that says so
        no MPS      ─► a warning: pipelines' processes on one GPU are time-sliced
    Choice.summary ─► the one line `jigsaw run` prints and writes to the daemon's log

`jigsaw run --profile/--devices` override what is chosen; `jigsaw daemon` itself never
detects (its flags are what it runs with).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from jigsaw.profiles import CPU_DEFAULT, GPU_DEFAULT_MODEL

SKU_FAMILIES = ("h100", "a100")
"""GPU families with shipped priors, matched in the NVML name ("NVIDIA H100 80GB HBM3")."""
FALLBACK_FAMILY = "h100"
"""The prior a GPU of another family gets (with a warning)."""


@dataclass(frozen=True, slots=True)
class Probe:
    """What was found on the node."""

    gpus: tuple[str, ...] = ()
    """NVML name of each GPU, in index order."""
    cores: int = 1
    """Cores this process may run on."""
    no_gpu: str = ""
    """Why no GPU was seen (NVML's error), when `gpus` is empty."""
    mps: str = ""
    """The MPS control daemon's state on a GPU node (jigsaw.mux.partition.mps.STATES); "": not looked at."""


@dataclass(frozen=True, slots=True)
class Choice:
    """What an on-demand daemon is started with (`dataclasses.replace` applies overrides)."""

    found: str
    """What the probe saw, in words."""
    devices: int
    profile: str
    """A grid name (jigsaw.profiles.resolve) or a file."""
    partitioner: str
    warnings: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        """One line: what was found and what was picked."""
        return f"{self.found}: {self.devices} device(s), grid {self.profile}, partitioner {self.partitioner}"


def family(gpu_name: str) -> str | None:
    """The family of an NVML name: "h100" for "NVIDIA H100 80GB HBM3", "a100" for
    "NVIDIA A100-SXM4-80GB"; None for another."""
    name = gpu_name.lower()
    return next((f for f in SKU_FAMILIES if f in name), None)


def choose(probe: Probe, model: str = GPU_DEFAULT_MODEL) -> Choice:
    """Devices, grid and partitioner for what `probe` found."""
    if not probe.gpus:
        why = f" ({probe.no_gpu})" if probe.no_gpu else ""
        return Choice(found=f"no GPU{why}, {probe.cores} core(s)", devices=1, profile=CPU_DEFAULT, partitioner="cpu")
    names = Counter(probe.gpus)
    found = ", ".join(f"{n} × {name}" for name, n in names.items())
    fam = family(probe.gpus[0])
    warnings = []
    if fam is None:
        warnings.append(f"no shipped prior for {probe.gpus[0]}: using the {FALLBACK_FAMILY} prior "
                        f"(measure one with `jigsaw profile`)")
    if len(names) > 1:
        warnings.append(f"GPUs of {len(names)} kinds; the grid is {probe.gpus[0]}'s")
    if probe.mps and probe.mps != "running":
        warnings.append(f"MPS is not running ({probe.mps}): processes of different pipelines on one GPU are "
                        "time-sliced, not run side by side; start it with `jigsaw daemon --mps`")
    profile = f"{fam or FALLBACK_FAMILY}/{model}"
    # NOTE: advisory, not green: on an H200 (driver 580, bench/gpu_check.py's smid2) the green
    # contexts of two MPS clients on opposite sides of one split ran on shared SMs.
    return Choice(found=found, devices=len(probe.gpus), profile=profile, partitioner="advisory",
                  warnings=tuple(warnings))


def probe() -> Probe:
    """The GPUs NVML sees and this process's cores; no NVML (no driver, no GPU) is no GPU."""
    from jigsaw.mux.partition.cpu import usable_cores

    cores = len(usable_cores())
    try:
        gpus = _nvml_names()
    except Exception as exc:  # noqa: BLE001 - pynvml missing, no driver, no device: a CPU node
        if isinstance(exc, ModuleNotFoundError) and exc.name == "pynvml":  # `pip install jigsaw` sees no GPU
            return Probe(cores=cores, no_gpu="nvidia-ml-py is not installed; on a GPU node: pip install 'jigsaw[gpu]'")
        return Probe(cores=cores, no_gpu=f"NVML: {str(exc) or type(exc).__name__}")
    if not gpus:
        return Probe(cores=cores, no_gpu="NVML sees none")
    from jigsaw.mux.partition.mps import status

    return Probe(gpus=gpus, cores=cores, mps=status().state)


def _nvml_names() -> tuple[str, ...]:
    import pynvml

    pynvml.nvmlInit()
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else name)
        return tuple(names)
    finally:
        pynvml.nvmlShutdown()
