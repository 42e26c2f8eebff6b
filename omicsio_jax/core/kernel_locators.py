"""numba cache locators for the kernels of the packages `check_kernel_caches` checked: numba's own
(``NUMBA_CACHE_DIR``, the module's ``__pycache__``, the user-wide folder, in numba's order), with
the packages' digests in each kernel's source stamp (`package_stamp`), then a folder of the
user's own in the temporary directory, and last, where even that cannot be had, a one-line error
naming ``NUMBA_CACHE_DIR``. Loaded with ``numba.core.caching`` (`kernel_cache`'s hook),
never by ``import omicsio_jax``.

A process whose ``TMPDIR`` is a folder of its own, removed when it stops (materialize's pool
workers), is given its parent's temporary directory in `TMPDIR_VARIABLE`: its kernels are cached
in the parent's private folder, where the next run finds them.
"""

from __future__ import annotations

import os
import tempfile

from numba.core import caching

from omicsio_jax.core.errors import OmicsIOError

# where the private folder is made, before the temporary directory (see the module docstring)
TMPDIR_VARIABLE = "OMICSIO_JAX_KERNEL_TMPDIR"


def _no_stamp(py_file: str) -> None:
    return None


_package_stamp = _no_stamp  # `kernel_cache.package_stamp`, given by `install`


class _Stamped:
    """A numba locator, for a checked package's modules only, whose source stamp carries the
    package's digests."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if _package_stamp(py_file) is None:
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        return (super().get_source_stamp(), _package_stamp(self._py_file))


def _numba_locator(name: str):
    """numba's locator class ``name`` (``_name`` before numba 0.62)."""
    return getattr(caching, name, None) or getattr(caching, f"_{name}")


class _UserProvided(_Stamped, _numba_locator("UserProvidedCacheLocator")):
    pass


class _InTree(_Stamped, _numba_locator("InTreeCacheLocator")):
    pass


class _UserWide(_Stamped, _numba_locator("UserWideCacheLocator")):
    """numba's user-wide folder, where it is an absolute path: without a home (no ``HOME``, a user id
    with no password entry) it is ``~/.cache/numba`` with ``~`` left as it is, or a relative
    ``XDG_CACHE_HOME``, which numba would make under the working directory of each process."""

    def ensure_cache_path(self):
        if not os.path.isabs(self._cache_path):
            raise OSError(f"no absolute user cache folder: {self._cache_path}")
        super().ensure_cache_path()


class _Temporary(_Stamped, _numba_locator("UserWideCacheLocator")):
    """Where no other folder can be written: ``omicsio-numba-<uid>`` in the temporary directory,
    made mode 0700 and used only while it is the user's own and no one else's to write (another
    user's folder of that name could hold machine code of theirs)."""

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        self._cache_path = os.path.join(_private_folder(), self.get_suitable_cache_subpath(py_file))

    def ensure_cache_path(self):
        if not _private_folder():
            raise OSError("no private temporary folder")
        super().ensure_cache_path()


class _Refused:
    """Last, for a checked package's kernel that no folder above takes (the private one another
    user's, open to others, or no temporary directory writable at all): a one-line error with the
    fix, not numba's "no locator available" from inside its decorator. A module that is no file (a
    zipped install) is left to numba's own."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if _package_stamp(py_file) is None or not os.path.exists(py_file):
            return None
        msg = (
            f"no folder to cache the compiled kernels of {py_file} in: numba's (NUMBA_CACHE_DIR, the "
            f"package's __pycache__, the user cache folder) cannot be written, and {_why_not_private()}; "
            "set NUMBA_CACHE_DIR to a folder you can write"
        )
        raise OmicsIOError(msg)


def _why_not_private() -> str:
    """Why `_private_folder` has none: no temporary directory, or its folder not this user's alone."""
    name = f"omicsio-numba-{os.getuid()}"
    try:
        folder = os.path.join(_temporary_directory(), name)
    except OSError:
        return f"no temporary directory can be written for {name} (TMPDIR, /tmp, the working directory)"
    if not os.path.lexists(folder):
        return f"{folder} cannot be made"
    return f"{folder} is not a folder of this user's alone (mode 0700)"


def _temporary_directory() -> str:
    """The folder of the private one: `TMPDIR_VARIABLE`'s where set, else the temporary directory."""
    return os.environ.get(TMPDIR_VARIABLE) or tempfile.gettempdir()


def _private_folder() -> str:
    try:
        folder = os.path.join(_temporary_directory(), f"omicsio-numba-{os.getuid()}")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError:
        return ""
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(folder) or os.path.islink(folder):
        return ""
    return folder


LOCATORS = (_UserProvided, _InTree, _UserWide, _Temporary, _Refused)


def install(module, package_stamp) -> None:
    """Put `LOCATORS` before numba's own in ``module`` (``numba.core.caching``), once, stamping the
    kernels of the modules ``package_stamp(py_file)`` gives digests for (`kernel_cache`'s; passed
    in, not imported: that module loads this one)."""
    global _package_stamp
    _package_stamp = package_stamp
    impl = getattr(module, "CacheImpl", None) or module._CacheImpl  # (_CacheImpl in older numba)
    if impl._locator_classes[: len(LOCATORS)] != list(LOCATORS):
        impl._locator_classes = [*LOCATORS, *(c for c in impl._locator_classes if c not in LOCATORS)]
