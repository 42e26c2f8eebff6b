"""numba's on-disk caches of a package's kernels, kept in step with every module they inline.

numba keys a cached kernel on the contents of its own file only ("changes in symbols defined in
another file are not recognized", its caching notes): a kernel that inlines a helper of another
module (the token, dense and statistics kernels inline the codec's decoders) would go on loading the
machine code built from the helper's previous version after that module changed: after a
``git pull``, or an upgrade that left numba's ``.nbi``/``.nbc`` files behind. Results would then be
wrong without an error.

`check_kernel_caches` does two things for a package. It keeps a stamp in the package's
``__pycache__``: the size and modification time of every module of the package (a stat each, a few
milliseconds in all), and a digest of their contents. When the modules' stat differs from the
stamp, the digest is taken again; when it differs too, every ``*.nbi`` and ``*.nbc`` file in the
package's ``__pycache__`` folders is removed. And it makes the digest part of the source stamp numba
keeps beside each of the package's cached kernels, wherever numba caches them (the package's
``__pycache__``, ``NUMBA_CACHE_DIR``, or a user-wide folder for a read-only install): a kernel
whose recorded stamp differs compiles again, and a package that inlines another's modules
(``depends_on``: materialize's kernels inline ``omicsio_jax``'s) has that package's digest in its
stamps too. Every module counts, not only those that use numba: a kernel takes the globals it reads
(constants of any module) as compile-time constants. A file touched but not changed (a checkout, a
reinstall of the same version) leaves the caches alone.

Where numba finds no folder it can write for a package's kernel (a read-only install without a
writable home), the kernel is cached in a folder of the user's own in the temporary directory
(mode 0700), not refused; where that folder is another user's too, the kernel's import stops with a
one-line `OmicsIOError` saying to set ``NUMBA_CACHE_DIR``.
"""

from __future__ import annotations

import os
import sys

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


def check_kernel_caches(root: str | os.PathLike, *, depends_on: tuple[str | os.PathLike, ...] = ()) -> bool:
    """Remove numba's cached kernels under the package folder ``root`` when a module of it changed
    since the last check, and stamp its kernels' caches wherever numba keeps them with the digests
    of ``root`` and of the packages ``depends_on`` (whose modules its kernels inline); returns
    whether it removed cached kernels. A package whose ``__pycache__`` cannot be written is left as
    it is, without an error (numba keeps its caches elsewhere then, stamped).

    >>> oj.check_kernel_caches(os.path.dirname(my_package.__file__))  # at the top of my_package  # doctest: +SKIP
    """
    root = os.path.abspath(os.fspath(root))
    digest, cleared = _check_in_tree(root)
    _DIGESTS[root] = digest
    _STAMPED[root] = (root, *(os.path.abspath(os.fspath(d)) for d in depends_on))
    _stamp_numba_caches()
    return cleared


_DIGESTS: dict[str, str | None] = {}  # a package root → its modules' digest (None: not taken yet)
_STAMPED: dict[str, tuple[str, ...]] = {}  # a package root → the roots whose digests stamp its kernels


def _check_in_tree(root: str) -> tuple[str | None, bool]:
    """The digest of ``root``'s modules (None where not known yet: taken when a kernel asks) and
    whether the cached kernels in its ``__pycache__`` folders were removed."""
    folder = os.path.join(root, "__pycache__")
    if not os.access(folder if os.path.isdir(folder) else root, os.W_OK):
        return None, False  # a read-only install: numba caches its kernels elsewhere, stamped
    stamp = os.path.join(folder, STAMP)
    modules = _modules(root)
    try:
        with open(stamp, encoding="utf-8") as f:
            recorded = f.read().split("\n")
    except (OSError, UnicodeDecodeError):
        recorded = [""]
    if recorded[1:] == modules:
        return recorded[0], False
    try:
        digest = kernel_digest(root, modules)
    except OSError:  # a module went away meanwhile (a checkout under way): the next import decides
        return None, False
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
    return digest, cleared


def _digest(root: str) -> str:
    found = _DIGESTS.get(root)
    if found is None:
        try:
            found = kernel_digest(root)
        except OSError:  # a module gone meanwhile: stamped by what can be read, taken again next time
            found = "unreadable"
        _DIGESTS[root] = found
    return found


def package_stamp(py_file: str) -> tuple[str, ...] | None:
    """The digests that stamp the cached kernels of module ``py_file``: of its package and those it
    depends on; None for a module of no checked package."""
    path = os.path.abspath(py_file)
    roots = [r for r in _STAMPED if path.startswith(r + os.sep)]
    if not roots:
        return None
    return tuple(_digest(r) for r in _STAMPED[max(roots, key=len)])


def _stamp_numba_caches() -> None:
    """Put `omicsio_jax.core.kernel_locators`' locators first among numba's, now if numba's caching
    module is loaded, else as it loads (a hook on its import: ``import omicsio_jax`` loads no numba)."""
    caching = sys.modules.get("numba.core.caching")
    if caching is not None:
        _install(caching)
    elif not any(isinstance(f, _CachingHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _CachingHook())


def _install(caching) -> None:
    from omicsio_jax.core.kernel_locators import install  # (imports numba: loaded with it, not before)

    install(caching, package_stamp)


class _CachingHook:
    """Finds ``numba.core.caching`` as the other finders do and installs the locators once it has
    run; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "numba.core.caching":
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None  # found by another finder (not a plain install): numba's own locators, unstamped
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            # (left here, not in find_spec: the import system is going through sys.meta_path then)
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            run(module)
            _install(module)

        spec.loader.exec_module = exec_module
        return spec
