"""How much memory, and how many cores' time, this process may use: the machine's, or less where a
cgroup limits it.

Inside a container with a memory limit, the host's RAM says nothing about what the page cache of
this process's cgroup can hold: a 30 GB dataset on a 256 GB host is beyond RAM for a job limited
to 16 GB. `memory_limit` is the smallest of the RAM and every cgroup limit on the way from this
process's cgroup to the root of its hierarchy (cgroup v2's ``memory.max``, v1's
``memory.limit_in_bytes``), as the JVM, .NET and Go runtimes read them. Likewise a container given
2 CPUs' time on a 16-core host sees 16 cores: `cpu_quota` reads the smallest CPU quota on the
same way (v2's ``cpu.max``, v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), in cores.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as the largest page-aligned int64


def _ram() -> int | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """``(root, mount point, fs type, super options)`` of each cgroup mount in ``/proc/self/mountinfo``."""
    found = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[3], fields[4], tail[0], tail[2]))
    return found


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max" (v2) or unreadable
        return None
    value = int(text)
    return value if 0 < value < _UNLIMITED else None


def cgroup_dirs(proc_cgroup: str, mountinfo: str, controller: str) -> list[tuple[str, Path]]:
    """``(version, folder)`` of each cgroup of this process from its own up to its hierarchy's root,
    v2's (``"cgroup2"``) and v1's of ``controller`` (``"cgroup"``), from the texts of
    ``/proc/self/cgroup`` and ``/proc/self/mountinfo``."""
    found = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, group = parts
        if controllers == "":
            wanted = "cgroup2"
        elif controller in controllers.split(","):
            wanted = "cgroup"
        else:
            continue
        for root, point, fstype, options in _mounts(mountinfo):
            if fstype != wanted or (wanted == "cgroup" and controller not in options.split(",")):
                continue
            # the cgroup's path is relative to the hierarchy's root; the mount shows the part from `root` down
            relative = os.path.relpath(group, root) if group.startswith(root) else group.lstrip("/")
            here = Path(point) / relative
            while True:
                found.append((wanted, here))
                if here == Path(point) or here.parent == here:
                    break
                here = here.parent
    return found


def cgroup_limits(proc_cgroup: str, mountinfo: str) -> list[int]:
    """Every memory limit on this process's cgroups (v2 and v1), from the texts of
    ``/proc/self/cgroup`` and ``/proc/self/mountinfo``."""
    limits = []
    for version, here in cgroup_dirs(proc_cgroup, mountinfo, "memory"):
        limit = _read_limit(here / ("memory.max" if version == "cgroup2" else "memory.limit_in_bytes"))
        if limit is not None:
            limits.append(limit)
    return limits


def _read_quota(version: str, here: Path) -> float | None:
    """A cgroup's CPU quota in cores (quota ÷ period), or None: none set, or unreadable."""
    try:
        if version == "cgroup2":
            quota, period = (here / "cpu.max").read_text().split()[:2]
        else:
            quota = (here / "cpu.cfs_quota_us").read_text().strip()
            period = (here / "cpu.cfs_period_us").read_text().strip()
    except (OSError, ValueError):
        return None
    if not (quota.isdigit() and period.isdigit()) or int(quota) <= 0 or int(period) <= 0:
        return None  # "max" (v2) or -1 (v1): no quota
    return int(quota) / int(period)


def cgroup_cpu_quotas(proc_cgroup: str, mountinfo: str) -> list[float]:
    """Every CPU quota on this process's cgroups (v2 and v1), in cores, from the texts of
    ``/proc/self/cgroup`` and ``/proc/self/mountinfo``."""
    quotas = (_read_quota(version, here) for version, here in cgroup_dirs(proc_cgroup, mountinfo, "cpu"))
    return [q for q in quotas if q is not None]


@functools.cache
def cpu_quota() -> int | None:
    """The cores' time this process's cgroups allow it (the smallest quota, rounded up, at least 1);
    None where none is set."""
    try:
        texts = Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    quotas = cgroup_cpu_quotas(*texts)
    return max(1, math.ceil(min(quotas))) if quotas else None


def memory_limit() -> int | None:
    """The memory this process may use, in bytes: the smaller of the machine's RAM and its cgroups'
    limits; None where neither is known."""
    try:
        texts = Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text()
    except OSError:
        texts = None
    known = ([] if texts is None else cgroup_limits(*texts)) + [r for r in (_ram(),) if r]
    return min(known) if known else None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one), or fewer where
    its cgroups give it less CPU time (a container's CPU quota, `cpu_quota`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else min(cores, quota)


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory(*, _finalizing=sys.is_finalizing) -> bool:
    """Hand the heap pages that freed buffers left behind back to the system (glibc's
    ``malloc_trim(0)``); False where the C library has no such call.

    glibc keeps freed memory in its arenas for reuse; after a dataset's readers, caches and batch
    buffers are freed, a long job that opens datasets again and again (a reopen after an object
    changed, a resume) would otherwise see its resident size creep by the freed-but-kept pages.
    False while the interpreter shuts down (a loader collected then: its memory goes with the process).
    (``_finalizing`` is bound at import: by then this module's globals, ``sys`` among them, may be None.)
    """
    if _finalizing():
        return False
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _huge_page_switch():
    """NumPy's switch of ``madvise(MADV_HUGEPAGE)`` for new arrays, or None where it has none (not
    Linux, or a NumPy that moved it)."""
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            module = __import__(name, fromlist=["_set_madvise_hugepage"])
        except ImportError:
            continue
        switch = getattr(module, "_set_madvise_hugepage", None)
        if switch is not None:
            return switch
    return None


_small_pages_lock = threading.Lock()
_small_pages_users = 0
_small_pages_before = True


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """New NumPy arrays without transparent huge pages while any thread is inside (reentrant); NumPy's
    own setting is back once the last one leaves.

    NumPy asks the kernel for huge pages for every array past 4 MB (``NUMPY_MADVISE_HUGEPAGE``, on
    by default), and the kernel zeroes each 2 MB page whole as it is first touched. That suits a
    buffer made once and used long (a loader's); a job that makes arrays of tens of MB and lets them
    go batch after batch (materialize's reading, remapping, statistics and merge) pays it again and
    again. Against the same code with huge pages, in the same rounds
    (`benchmarks/results/archive/collection_a884835.json`, 2 workers on a 2-core AMD EPYC): a
    50-source collection 1.07× the cells/s, its cells as one source 1.03×.
    """
    global _small_pages_users, _small_pages_before
    switch = _huge_page_switch()
    if switch is None:
        yield
        return
    with _small_pages_lock:
        if _small_pages_users == 0:
            _small_pages_before = switch(False)
        _small_pages_users += 1
    try:
        yield
    finally:
        with _small_pages_lock:
            _small_pages_users -= 1
            if _small_pages_users == 0:
                switch(_small_pages_before)
