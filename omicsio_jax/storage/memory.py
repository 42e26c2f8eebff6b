"""How much memory this process may use: the machine's RAM, or less where a cgroup limits it.

Inside a container with a memory limit, the host's RAM says nothing about what the page cache of
this process's cgroup can hold: a 30 GB dataset on a 256 GB host is beyond RAM for a job limited
to 16 GB. `memory_limit` is the smallest of the RAM and every cgroup limit on the way from this
process's cgroup to the root of its hierarchy (cgroup v2's ``memory.max``, v1's
``memory.limit_in_bytes``), as the JVM, .NET and Go runtimes read them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
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


def cgroup_limits(proc_cgroup: str, mountinfo: str) -> list[int]:
    """Every memory limit on this process's cgroups (v2 and v1), from the texts of
    ``/proc/self/cgroup`` and ``/proc/self/mountinfo``."""
    limits = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, group = parts
        if controllers == "":
            wanted, file = "cgroup2", "memory.max"
        elif "memory" in controllers.split(","):
            wanted, file = "cgroup", "memory.limit_in_bytes"
        else:
            continue
        for root, point, fstype, options in _mounts(mountinfo):
            if fstype != wanted or (wanted == "cgroup" and "memory" not in options.split(",")):
                continue
            # the cgroup's path is relative to the hierarchy's root; the mount shows the part from `root` down
            relative = os.path.relpath(group, root) if group.startswith(root) else group.lstrip("/")
            here = Path(point) / relative
            while True:
                limit = _read_limit(here / file)
                if limit is not None:
                    limits.append(limit)
                if here == Path(point) or here.parent == here:
                    break
                here = here.parent
    return limits


def memory_limit() -> int | None:
    """The memory this process may use, in bytes: the smaller of the machine's RAM and its cgroups'
    limits; None where neither is known."""
    try:
        texts = Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text()
    except OSError:
        texts = None
    known = ([] if texts is None else cgroup_limits(*texts)) + [r for r in (_ram(),) if r]
    return min(known) if known else None


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Hand the heap pages that freed buffers left behind back to the system (glibc's
    ``malloc_trim(0)``); False where the C library has no such call.

    glibc keeps freed memory in its arenas for reuse; after a dataset's readers, caches and batch
    buffers are freed, a long job that opens datasets again and again (a reopen after an object
    changed, a resume) would otherwise see its resident size creep by the freed-but-kept pages.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
