"""A CPU-time cap on a group of processes (cgroups): the CPU analogue of an MPS thread percentage.

    CpuQuota.create(name, cpus) ─► a cgroup of its own with the cpu controller:
        v2  <cgroup2 mount>/<name>/cpu.max          "<cpus × period> <period>"
        v1  <cpu controller mount>/<name>/cpu.cfs_quota_us, cpu.cfs_period_us
    join(pid)  ─► the process, and every process it starts later, is held to `cpus` CPUs' worth
                  of time per period, on whichever cores the OS picks (no pinning)
    remove()   ─► the group, once its processes have exited

A core set can split a machine only into whole cores; three pipelines on two cores get two
thirds of a CPU each only from a time cap.  Making a cgroup needs write access to a hierarchy
with the cpu controller (root, or a delegated subtree): QuotaUnavailable says what is missing.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PERIOD_US = 100_000
MOUNTINFO = Path("/proc/self/mountinfo")


class QuotaUnavailable(RuntimeError):
    """No cgroup hierarchy with the cpu controller can be written here."""


@dataclass(frozen=True, slots=True)
class CpuQuota:
    path: Path
    """The cgroup's directory."""
    v2: bool
    cpus: float

    @classmethod
    def create(cls, name: str, cpus: float, mountinfo: Path = MOUNTINFO) -> CpuQuota:
        if not 0.0 < cpus:
            raise ValueError(f"a CPU quota of {cpus} CPUs holds no time")
        root, v2 = cpu_hierarchy(mountinfo)
        path = root / name
        quota_us = max(1000, round(cpus * PERIOD_US))
        try:
            path.mkdir(exist_ok=True)
            if v2:
                (path / "cpu.max").write_text(f"{quota_us} {PERIOD_US}\n")
            else:
                (path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
                (path / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
        except OSError as exc:
            raise QuotaUnavailable(f"cannot make the cgroup {path} with a CPU quota: {exc} (needs root or a "
                                   "delegated cgroup subtree)") from exc
        return cls(path=path, v2=v2, cpus=cpus)

    def join(self, pid: int = 0) -> None:
        """Put process `pid` (0: the caller) in the group; the processes it starts later follow."""
        (self.path / "cgroup.procs").write_text(f"{pid or os.getpid()}\n")

    def remove(self, wait_s: float = 10.0) -> bool:
        """Remove the group once the processes in it have exited (a pipeline's workers may still
        be on their way out when it returns), waiting at most `wait_s`; whether it is gone."""
        deadline = time.monotonic() + wait_s
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError:
                if time.monotonic() >= deadline:
                    return False  # a process outlived its pipeline: the group stays, capping it
                time.sleep(0.05)
        return True


def cpu_hierarchy(mountinfo: Path = MOUNTINFO) -> tuple[Path, bool]:
    """(directory, is v2) of a writable cgroup hierarchy with the cpu controller."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError as exc:
        raise QuotaUnavailable(f"cannot read {mountinfo}: {exc}") from exc
    v1 = v2 = None
    for line in lines:
        fields = line.split()
        sep = fields.index("-") if "-" in fields else -1
        if sep < 0 or len(fields) < sep + 3:
            continue
        mount, fstype, options = Path(fields[4]), fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup" and "cpu" in options:
            v1 = mount
        elif fstype == "cgroup2" and "cpu" in _controllers(mount):
            v2 = mount
    if v2 is not None and _enable_cpu(v2):
        return v2, True
    if v1 is not None:
        return v1, False
    raise QuotaUnavailable("no cgroup hierarchy here has the cpu controller (cgroup v1 `cpu` or cgroup v2 with "
                           "`cpu` in cgroup.controllers)")


def _controllers(mount: Path) -> list[str]:
    try:
        return (mount / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def _enable_cpu(mount: Path) -> bool:
    """Whether the v2 root hands the cpu controller to its children (switched on if it can be)."""
    control = mount / "cgroup.subtree_control"
    try:
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu\n")
        return True
    except OSError:
        return False


__all__ = ["CpuQuota", "QuotaUnavailable", "cpu_hierarchy"]
