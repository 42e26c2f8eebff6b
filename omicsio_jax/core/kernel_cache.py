"""numba's on-disk caches of a package's kernels, kept in step with every module they inline.

numba keys a cached kernel on the contents of its own file only ("changes in symbols defined in
another file are not recognized", its caching notes): a kernel that inlines a helper of another
module (the token, dense and statistics kernels inline the codec's decoders) would go on loading the
machine code built from the helper's previous version after that module changed: after a
``git pull``, or an upgrade that left numba's ``.nbi``/``.nbc`` files behind in ``__pycache__``.
Results would then be wrong without an error.

`check_kernel_caches` keeps a stamp in the package's ``__pycache__``: the size and modification time
of every module of the package (a stat each, a few milliseconds in all), and a digest of their
contents. When the modules' stat differs from the stamp, the digest is taken again; when it differs
too, every ``*.nbi`` and ``*.nbc`` file in the package's ``__pycache__`` folders is removed, so each
kernel compiles once more on first use. Every module counts, not only those that use numba: a kernel
takes the globals it reads (constants of any module) as compile-time constants. A file touched but
not changed (a checkout, a reinstall of the same version) leaves the caches alone. Caches that numba
keeps elsewhere (``NUMBA_CACHE_DIR``, or a user-wide folder for a read-only install) are not
touched: a read-only install does not change under them.
"""

from __future__ import annotations

import os

STAMP = "omicsio-kernels.stamp"  # in the package's top __pycache__: the digest, then one line per module
_CACHE_SUFFIXES = (".nbi", ".nbc")


def _modules(root: str) -> list[str]:
    """``relative path<TAB>size<TAB>mtime_ns`` of every ``.py`` file under ``root``, in a fixed order."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                st = os.stat(path)
                found.append(f"{os.path.relpath(path, root)}\t{st.st_size}\t{st.st_mtime_ns}")
    return found


def kernel_digest(root: str | os.PathLike, modules: list[str] | None = None) -> str:
    """SHA-256 over the path and contents of every module under ``root``."""
    import hashlib  # here, not at import: the common case, nothing changed, needs no digest

    root = os.fspath(root)
    h = hashlib.sha256()
    for line in _modules(root) if modules is None else modules:
        rel = line.split("\t", 1)[0]
        with open(os.path.join(root, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def check_kernel_caches(root: str | os.PathLike) -> bool:
    """Remove numba's cached kernels under the package folder ``root`` when a module of it changed
    since the last check; returns whether it removed them. A package whose ``__pycache__`` cannot be
    written is left as it is, without an error (numba keeps its caches elsewhere then).

    >>> oj.check_kernel_caches(os.path.dirname(my_package.__file__))  # at the top of my_package  # doctest: +SKIP
    """
    root = os.fspath(root)
    folder = os.path.join(root, "__pycache__")
    if not os.access(folder if os.path.isdir(folder) else root, os.W_OK):
        return False  # a read-only install: numba caches its kernels elsewhere, and nothing changes here
    stamp = os.path.join(folder, STAMP)
    modules = _modules(root)
    try:
        with open(stamp, encoding="utf-8") as f:
            recorded = f.read().split("\n")
    except (OSError, UnicodeDecodeError):
        recorded = [""]
    if recorded[1:] == modules:
        return False
    try:
        digest = kernel_digest(root, modules)
    except OSError:  # a module went away meanwhile (a checkout under way): the next import decides
        return False
    cleared = recorded[0] != digest
    if cleared:
        for here, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            if os.path.basename(here) != "__pycache__":
                continue
            for name in files:
                if name.endswith(_CACHE_SUFFIXES):
                    try:
                        os.unlink(os.path.join(here, name))
                    except OSError:
                        pass  # removed by another process meanwhile, or not ours to remove
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{stamp}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join([digest, *modules]))
        os.replace(tmp, stamp)  # whole or not at all, with several processes starting at once
    except OSError:
        pass
    return cleared
