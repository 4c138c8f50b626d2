"""verl 0.9.1 on a machine without an accelerator: a CPU platform for verl's `PlatformRegistry`.

    import verl ─► entry point `verl.plugins` (jigsaw.integrations.verl.plugin) ─► register()
        PlatformRegistry["cpu"] = CpuPlatform            (every process that imports verl)
        VERL_PLATFORM=cpu selects it ─► patch():          (only then, and once per process)
            VERL_ENGINE_DEVICE=cuda    the FSDP engine is registered for cuda/npu only; it runs
                                       on `get_device_name()`, which is "cpu" here
            init_process_group         verl asks for "cpu:gloo,cpu:gloo", torch refuses duplicates
            Tensor.pin_memory          the forward-only FSDP2 engine pins its CPU offload; no CUDA

The platform is never auto-detected (`is_platform_available` is False): a CPU run is asked for
with `VERL_PLATFORM=cpu`, so a GPU job that merely has jigsaw installed is untouched.  Ray has
no "CPU accelerator", so the job also gives Ray fake GPUs (`+ray_kwargs.ray_init.num_gpus=N`)
that this platform names as its resource.
"""

from __future__ import annotations

import contextlib
import os
import types

PLATFORM = "cpu"
"""The name `VERL_PLATFORM` selects."""


def selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM


def _device_module() -> types.ModuleType:
    """`torch.cpu` with the calls verl makes on an accelerator module, as no-ops where a CPU has
    nothing to do (caches, seeds of a device RNG, memory queries answered from the host)."""
    import psutil
    import torch

    mod = types.ModuleType("jigsaw_verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.empty_cache = lambda: None
    mod.manual_seed = mod.manual_seed_all = lambda seed: None
    mod.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mod.mem_get_info = lambda *a, **k: (psutil.virtual_memory().available, psutil.virtual_memory().total)
    mod.memory_allocated = mod.memory_reserved = mod.max_memory_allocated = lambda *a, **k: 0
    mod.max_memory_reserved = mod.reset_peak_memory_stats = lambda *a, **k: 0
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: "cpu"
    mod.set_device = lambda *a, **k: None
    mod.synchronize = lambda *a, **k: None
    mod.get_device_name = lambda *a, **k: "CPU"  # verl's MFU table has no entry: peak FLOPs unknown
    mod.set_per_process_memory_fraction = mod.ipc_collect = lambda *a, **k: None
    return mod


def platform_class():
    """The platform class (built on first use: verl is imported only where it runs)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class CpuPlatform(PlatformBase):
        """verl's device hooks answered for the host CPU; collectives over gloo."""

        device_name = "cpu"
        vendor_name = "cpu"

        @property
        def device_module(self):
            return _device_module()

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return False  # chosen with VERL_PLATFORM=cpu only, never guessed

        def current_device(self):
            return "cpu"  # not 0: `.to(get_device_id())` must stay on the host

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            pass

        def manual_seed_all(self, seed: int) -> None:
            pass

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # Ray sets it for its fake GPUs; nothing reads it here

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "GPU"  # the job's fake Ray GPUs: verl's placement counts only GPU/NPU bundles

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False  # weights go to the rollout through Ray's object store

        def cudart(self):
            return None

    return CpuPlatform


def register() -> None:
    """Add the platform to verl's registry (harmless where it is not selected)."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    PlatformRegistry.register(platform=PLATFORM)(platform_class())
    if selected():
        patch()


_patched = False


def patch() -> None:
    """What verl 0.9.1 needs besides the platform to train on the host (once per process)."""
    global _patched
    if _patched:
        return
    _patched = True
    import torch
    import torch.distributed as dist

    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    init = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if isinstance(backend, str) and "," in backend:
            backend = ",".join(dict.fromkeys(backend.split(",")))  # "cpu:gloo,cpu:gloo" -> "cpu:gloo"
        return init(backend, *args, **kwargs)

    dist.init_process_group = init_process_group
    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = lambda self, *a, **k: self
