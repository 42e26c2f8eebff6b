"""`exchange_paths`: two folders swapped in one step, where the system allows it.

Replacing a folder by renames leaves a moment with no folder at its path: the old one moved aside,
the new one not yet in. A reader opening it then finds nothing, and a process killed then leaves
nothing there. Linux's ``renameat2`` with ``RENAME_EXCHANGE`` (kernel 3.15, glibc 2.28; ext4, XFS,
Btrfs, tmpfs and others, not NFS) swaps two paths at once, so the path always names one of them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

_AT_FDCWD = -100  # paths relative to the working directory, as rename's
_RENAME_EXCHANGE = 2
# where the system or the file system has no such swap: the kernel, the file system, a sandbox's
# seccomp filter (which may answer EPERM), or no renameat2 in the C library at all
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM}


@functools.cache
def _renameat2():
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a C library without it
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange_paths(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Swap what ``a`` and ``b`` name (both present, on one file system) in one step; True once done,
    False, with nothing moved, where this system or file system cannot (the caller renames in two
    steps instead). Another failure (a path missing, no access) is an `OSError`."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))
