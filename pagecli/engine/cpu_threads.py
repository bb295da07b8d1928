"""The default CPU thread count: the physical cores this process may run on, like llama.cpp.

The CPUs of the affinity mask are grouped into physical cores by the sysfs topology (a core's
hyperthreads share its execution units, so a second thread per core only adds contention to
memory-bound decode), then capped by the cgroup's CPU quota (a container limited to 4 CPUs of
time on a 64-core host throttles 64 threads). Every file read may fail: the fallback is the
count of allowed logical CPUs, and the result is always at least 1. Nothing is pinned.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadChoice:
    """A CPU thread count and, for displays, why it was chosen."""

    num_threads: int
    reason: str


def allowed_cpus() -> frozenset[int]:
    """The logical CPUs this process may run on (all of them where affinity is unknown)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity on macOS and Windows
        return frozenset(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list such as `0-3,8-11` or `0,8`; ValueError when malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _core_key(cpu: int, sysfs_cpu: Path) -> object | None:
    """What identifies `cpu`'s physical core: the set of its hardware threads, or else its
    (package, core id) pair; None when the topology cannot be read."""
    topology = sysfs_cpu / f"cpu{cpu}" / "topology"
    for name in ("core_cpus_list", "thread_siblings_list"):  # the new name, then the old
        text = _read(topology / name)
        if text:
            try:
                return parse_cpu_list(text)
            except ValueError:
                pass
    package, core = _read(topology / "physical_package_id"), _read(topology / "core_id")
    if package is None or core is None:
        return None
    return (package, core)  # core ids repeat across packages


def physical_cores(cpus: Collection[int], sysfs_cpu: Path = SYSFS_CPU) -> int | None:
    """How many physical cores the logical `cpus` belong to; None when the topology of any
    of them cannot be read (the caller then counts logical CPUs)."""
    keys = set()
    for cpu in cpus:
        key = _core_key(cpu, sysfs_cpu)
        if key is None:
            return None
        keys.add(key)
    return len(keys) or None


def _v2_limit(folder: Path) -> float | None:
    """CPUs of time per period in a cgroup v2 `cpu.max` ("quota period" or "max period")."""
    text = _read(folder / "cpu.max")
    if text is None:
        return None
    quota, _, period = text.partition(" ")
    try:
        return int(quota) / int(period or 100_000) if quota != "max" else None
    except (ValueError, ZeroDivisionError):
        return None


def _v1_limit(folder: Path) -> float | None:
    """CPUs of time per period from cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        if quota is None or period is None or int(quota) <= 0:  # -1: no quota
            return None
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _limits_along(mount: Path, path: str, limit: Callable[[Path], float | None]) -> list[float]:
    """The limits of the process's cgroup and of every ancestor up to the mount (each applies).

    Inside a container the mount is often the container's own cgroup while /proc/self/cgroup
    still names the host's path: then the walk starts at the mount itself.
    """
    if not mount.is_dir():
        return []
    folder = mount / path.strip("/")
    if not folder.is_dir():
        folder = mount
    limits = []
    while True:
        value = limit(folder)
        if value is not None:
            limits.append(value)
        if folder == mount or mount not in folder.parents:
            return limits
        folder = folder.parent


def cgroup_cpu_quota(
    proc_cgroup: Path = PROC_SELF_CGROUP, cgroup_root: Path = CGROUP_ROOT
) -> float | None:
    """The CPUs' worth of time the process's cgroups grant per period (the smallest quota of
    cgroup v2 `cpu.max` and v1 `cpu.cfs_quota_us` along its path); None when unlimited or
    unreadable."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    limits: list[float] = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2; `unified` in a hybrid layout
            for mount in (cgroup_root, cgroup_root / "unified"):
                limits += _limits_along(mount, path, _v2_limit)
        elif "cpu" in controllers.split(","):  # v1: mounted as cpu or cpu,cpuacct
            mounts = dict.fromkeys((controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"))
            for mount in mounts:
                limits += _limits_along(cgroup_root / mount, path, _v1_limit)
    return min(limits) if limits else None


def default_threads(
    cpus: Collection[int],
    sysfs_cpu: Path = SYSFS_CPU,
    proc_cgroup: Path = PROC_SELF_CGROUP,
    cgroup_root: Path = CGROUP_ROOT,
) -> ThreadChoice:
    """One thread per physical core among `cpus`, capped by the cgroup quota, at least 1.

    A fractional quota rounds down (1.5 CPUs: 1 thread): threads beyond the CPU time granted
    get throttled mid-step while the others wait for them at each parallel region's barrier.
    """
    num_cpus = len(cpus)
    cpus_text = f"{num_cpus} CPU{'s' if num_cpus != 1 else ''} allowed"
    cores = physical_cores(cpus, sysfs_cpu)
    if cores is None:
        threads, reason = max(num_cpus, 1), f"{cpus_text} (core topology unreadable)"
    else:
        threads, reason = cores, f"{cores} physical core{'s' if cores != 1 else ''} of {cpus_text}"
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        reason += f"; cgroup quota {quota:g} CPUs"
        if quota < threads:
            threads = max(math.floor(quota), 1)
            reason += f": {threads} thread{'s' if threads != 1 else ''}"
    return ThreadChoice(threads, reason)


def choose_threads(
    requested: int | None,
    cpus: Collection[int] | None = None,
    sysfs_cpu: Path = SYSFS_CPU,
    proc_cgroup: Path = PROC_SELF_CGROUP,
    cgroup_root: Path = CGROUP_ROOT,
) -> ThreadChoice:
    """`requested` threads when given (`num_threads`, `--threads`), else the default over
    `cpus` (the process's affinity mask when None)."""
    if requested is not None:
        return ThreadChoice(requested, "as asked (--threads)")
    if cpus is None:
        cpus = allowed_cpus()
    return default_threads(cpus, sysfs_cpu, proc_cgroup, cgroup_root)


def cpu_model(default: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (`model name` of /proc/cpuinfo), else `default`."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default
