"""The default CPU thread count over faked affinity masks, sysfs topologies and cgroups."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagecli.config import EngineConfig
from pagecli.engine.cpu_threads import (
    ThreadChoice,
    cgroup_cpu_quota,
    choose_threads,
    parse_cpu_list,
    physical_cores,
)

ALL_8 = frozenset(range(8))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def hyperthreaded(root: Path, num_cores: int = 4, siblings_name: str = "core_cpus_list") -> Path:
    """sysfs for `num_cores` cores of two threads each, Linux-numbered: cpuN and cpuN+cores."""
    sysfs = root / "sys" / "devices" / "system" / "cpu"
    for core in range(num_cores):
        for cpu in (core, core + num_cores):
            topology = sysfs / f"cpu{cpu}" / "topology"
            write(topology / siblings_name, f"{core},{core + num_cores}")
            write(topology / "core_id", str(core))
            write(topology / "physical_package_id", "0")
    return sysfs


def cgroups(root: Path, proc_lines: list[str], files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup of `proc_lines` and a /sys/fs/cgroup holding `files`."""
    proc, mount = root / "proc" / "self" / "cgroup", root / "sys" / "fs" / "cgroup"
    write(proc, "\n".join(proc_lines))
    mount.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write(mount / name, text)
    return proc, mount


def choose(tmp_path: Path, cpus=ALL_8, requested=None, sysfs=None, proc=None, mount=None):
    return choose_threads(
        requested,
        cpus,
        sysfs or tmp_path / "no-sysfs",
        proc or tmp_path / "no-proc",
        mount or tmp_path / "no-cgroup",
    )


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8-11\n") == frozenset({0, 1, 2, 3, 8, 9, 10, 11})
    assert parse_cpu_list("5") == frozenset({5})
    with pytest.raises(ValueError):
        parse_cpu_list("0-x")


def test_hyperthread_siblings_count_once(tmp_path):
    sysfs = hyperthreaded(tmp_path)
    assert choose(tmp_path, sysfs=sysfs) == ThreadChoice(4, "4 physical cores of 8 CPUs allowed")


def test_old_sibling_file_name(tmp_path):
    sysfs = hyperthreaded(tmp_path, siblings_name="thread_siblings_list")
    assert physical_cores(ALL_8, sysfs) == 4


def test_affinity_covering_part_of_the_cores(tmp_path):
    sysfs = hyperthreaded(tmp_path)
    # cores 0 and 1 (cpu 4 is core 0's sibling); cores 2 and 3 are not allowed
    choice = choose(tmp_path, cpus={0, 1, 4}, sysfs=sysfs)
    assert choice == ThreadChoice(2, "2 physical cores of 3 CPUs allowed")


def test_core_ids_repeat_across_packages(tmp_path):
    sysfs = tmp_path / "cpu"
    for cpu in range(8):  # 2 packages x 2 cores x 2 threads; no sibling lists
        topology = sysfs / f"cpu{cpu}" / "topology"
        write(topology / "physical_package_id", str(cpu // 4))
        write(topology / "core_id", str(cpu % 2))
    assert physical_cores(ALL_8, sysfs) == 4
    assert physical_cores({0, 2}, sysfs) == 1  # two threads of package 0's core 0


def test_missing_topology_counts_logical_cpus(tmp_path):
    assert choose(tmp_path) == ThreadChoice(8, "8 CPUs allowed (core topology unreadable)")
    sysfs = hyperthreaded(tmp_path)
    (sysfs / "cpu3" / "topology" / "core_cpus_list").unlink()
    (sysfs / "cpu3" / "topology" / "core_id").unlink()
    assert physical_cores(ALL_8, sysfs) is None  # one unreadable CPU: count logical CPUs
    assert choose(tmp_path, sysfs=sysfs).num_threads == 8


def test_cgroup_v2_quota_below_the_cores_rounds_down(tmp_path):
    sysfs = hyperthreaded(tmp_path)
    proc, mount = cgroups(tmp_path, ["0::/job"], {"job/cpu.max": "250000 100000"})
    assert cgroup_cpu_quota(proc, mount) == 2.5
    choice = choose(tmp_path, sysfs=sysfs, proc=proc, mount=mount)
    assert choice == ThreadChoice(
        2, "4 physical cores of 8 CPUs allowed; cgroup quota 2.5 CPUs: 2 threads"
    )


def test_cgroup_v2_quota_under_one_cpu_still_runs_one_thread(tmp_path):
    proc, mount = cgroups(tmp_path, ["0::/"], {"cpu.max": "50000 100000"})
    assert choose(tmp_path, proc=proc, mount=mount).num_threads == 1


def test_cgroup_v2_max_is_no_quota(tmp_path):
    sysfs = hyperthreaded(tmp_path)
    proc, mount = cgroups(tmp_path, ["0::/job"], {"job/cpu.max": "max 100000"})
    assert cgroup_cpu_quota(proc, mount) is None
    choice = choose(tmp_path, sysfs=sysfs, proc=proc, mount=mount)
    assert choice == ThreadChoice(4, "4 physical cores of 8 CPUs allowed")


def test_cgroup_v2_quota_above_the_cores_changes_nothing(tmp_path):
    sysfs = hyperthreaded(tmp_path)
    proc, mount = cgroups(tmp_path, ["0::/job"], {"job/cpu.max": "1200000 100000"})
    choice = choose(tmp_path, sysfs=sysfs, proc=proc, mount=mount)
    assert choice == ThreadChoice(4, "4 physical cores of 8 CPUs allowed; cgroup quota 12 CPUs")


def test_cgroup_v2_parent_quota_applies(tmp_path):
    files = {"a/cpu.max": "300000 100000", "a/b/cpu.max": "max 100000"}
    proc, mount = cgroups(tmp_path, ["0::/a/b"], files)
    assert cgroup_cpu_quota(proc, mount) == 3.0
    assert choose(tmp_path, proc=proc, mount=mount).num_threads == 3


def test_container_whose_mount_is_its_own_cgroup(tmp_path):
    # /proc/self/cgroup names the host's path; the mount holds the container's files
    proc, mount = cgroups(tmp_path, ["0::/docker/abc123"], {"cpu.max": "600000 100000"})
    assert cgroup_cpu_quota(proc, mount) == 6.0


def test_cgroup_v1_quota(tmp_path):
    files = {
        "cpu,cpuacct/job/cpu.cfs_quota_us": "150000",
        "cpu,cpuacct/job/cpu.cfs_period_us": "50000",
    }
    proc, mount = cgroups(tmp_path, ["4:memory:/job", "3:cpu,cpuacct:/job", "0::/"], files)
    assert cgroup_cpu_quota(proc, mount) == 3.0
    sysfs = hyperthreaded(tmp_path)
    choice = choose(tmp_path, sysfs=sysfs, proc=proc, mount=mount)
    assert choice == ThreadChoice(
        3, "4 physical cores of 8 CPUs allowed; cgroup quota 3 CPUs: 3 threads"
    )


def test_cgroup_v1_no_quota_in_a_hybrid_layout(tmp_path):
    files = {
        "cpu/cpu.cfs_quota_us": "-1",
        "cpu/cpu.cfs_period_us": "100000",
        "unified/cgroup.procs": "",
    }
    proc, mount = cgroups(tmp_path, ["1:cpu:/", "0::/"], files)
    assert cgroup_cpu_quota(proc, mount) is None
    assert choose(tmp_path, proc=proc, mount=mount).num_threads == 8


@pytest.mark.parametrize(
    "files",
    [
        {},  # no cgroup files at all
        {"job/cpu.max": "garbage"},
        {"job/cpu.max": "100000 0"},
        {"cpu/job/cpu.cfs_quota_us": "100000"},  # v1 quota without its period
    ],
)
def test_missing_or_malformed_cgroup_files_mean_no_quota(tmp_path, files):
    proc, mount = cgroups(tmp_path, ["0::/job", "1:cpu:/job"], files)
    assert cgroup_cpu_quota(proc, mount) is None
    assert cgroup_cpu_quota(tmp_path / "absent", mount) is None
    assert choose(tmp_path, proc=proc, mount=mount).num_threads == 8


def test_no_cpus_still_one_thread(tmp_path):
    assert choose(tmp_path, cpus=frozenset()).num_threads == 1


def test_explicit_num_threads_overrides(tmp_path):
    sysfs = hyperthreaded(tmp_path)
    proc, mount = cgroups(tmp_path, ["0::/"], {"cpu.max": "100000 100000"})
    config = EngineConfig(num_threads=6)
    choice = choose(tmp_path, requested=config.num_threads, sysfs=sysfs, proc=proc, mount=mount)
    assert choice == ThreadChoice(6, "as asked (--threads)")
    assert EngineConfig().num_threads is None  # None: the default above
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0)


def test_this_machine():
    """The real files: never more threads than allowed CPUs, never fewer than 1."""
    choice = choose_threads(None)
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= choice.num_threads <= allowed
    assert "allowed" in choice.reason
