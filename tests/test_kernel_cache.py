"""numba's cached kernels follow the modules they inline (`omicsio_jax.core.kernel_cache`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omicsio_jax import OmicsIOError, check_kernel_caches

ROOT = Path(__file__).resolve().parent.parent

KERNEL = """
import numba as nb
from {pkg}.helper import step

@nb.njit(cache=True)
def kernel(x):
    return step(x)
"""


def make_package(tmp: Path, name: str, *, checked: bool) -> Path:
    """A package whose cached kernel inlines a helper of another of its modules."""
    pkg = tmp / name
    pkg.mkdir()
    init = "import os\nfrom omicsio_jax import check_kernel_caches\ncheck_kernel_caches(os.path.dirname(__file__))\n"
    (pkg / "__init__.py").write_text(init if checked else "")
    (pkg / "helper.py").write_text(
        "import numba as nb\n\n@nb.njit(inline='always')\ndef step(x):\n    return x + 1\n"
    )
    (pkg / "kernel.py").write_text(textwrap.dedent(KERNEL.format(pkg=name)))
    return pkg


def run_kernel(
    tmp: Path, name: str, *, cache_dir: Path | None = None, env: dict | None = None, cwd: Path | None = None
) -> int:
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)])}
    env.pop("NUMBA_CACHE_DIR", None)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    code = f"from {name}.kernel import kernel; print(kernel(1))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


def cached_files(pkg: Path) -> list[str]:
    return sorted(p.name for p in (pkg / "__pycache__").glob("*.nb[ic]"))


def test_a_kernel_compiles_again_when_a_module_it_inlines_changes(tmp_path):
    checked = make_package(tmp_path, "checked_pkg", checked=True)
    plain = make_package(tmp_path, "plain_pkg", checked=False)
    assert run_kernel(tmp_path, "checked_pkg") == 2
    assert run_kernel(tmp_path, "plain_pkg") == 2
    assert cached_files(checked) and cached_files(plain)  # both kernels were cached
    for pkg in (checked, plain):  # the helper changes; the kernel's own file does not
        (pkg / "helper.py").write_text(
            "import numba as nb\n\n@nb.njit(inline='always')\ndef step(x):\n    return x + 2\n"
        )
    # numba alone loads the machine code of the old helper: the hazard the check removes
    assert run_kernel(tmp_path, "plain_pkg") == 2
    assert run_kernel(tmp_path, "checked_pkg") == 3
    assert run_kernel(tmp_path, "checked_pkg") == 3  # and caches the new one


def test_caches_stay_when_no_module_changed_and_go_when_one_did(tmp_path):
    pkg = make_package(tmp_path, "pkg", checked=False)
    cache = pkg / "__pycache__"
    cache.mkdir()
    assert check_kernel_caches(pkg) is True  # no stamp yet: whatever is cached was built unchecked
    (cache / "kernel.kernel-5.py311.nbi").write_bytes(b"index")
    (cache / "kernel.kernel-5.py311.1.nbc").write_bytes(b"code")
    (cache / "kernel.cpython-311.pyc").write_bytes(b"pyc")
    assert check_kernel_caches(pkg) is False
    os.utime(pkg / "helper.py", ns=(1, 1))  # touched, same contents: the digest decides
    assert check_kernel_caches(pkg) is False
    assert len(cached_files(pkg)) == 2
    with open(pkg / "helper.py", "a") as f:
        f.write("# changed\n")
    assert check_kernel_caches(pkg) is True
    assert cached_files(pkg) == []
    assert (cache / "kernel.cpython-311.pyc").exists()  # Python's own caches are left alone
    assert check_kernel_caches(pkg) is False
    (pkg / "sub").mkdir()  # a new module counts too
    (pkg / "sub" / "__init__.py").write_text("LIMIT = 3\n")
    assert check_kernel_caches(pkg) is True


def test_a_package_whose_caches_cannot_be_written_is_checked_without_an_error(tmp_path):
    pkg = make_package(tmp_path, "pkg", checked=False)
    (pkg / "__pycache__").write_text("a file where the folder would be")  # no stamp can be kept
    assert check_kernel_caches(pkg) is True  # nothing recorded, nothing to remove, no error
    assert check_kernel_caches(pkg) is True
    assert (pkg / "__pycache__").read_text() == "a file where the folder would be"


def test_a_module_gone_while_checking_leaves_the_decision_to_the_next_import(tmp_path, monkeypatch):
    from omicsio_jax.core import kernel_cache

    pkg = make_package(tmp_path, "pkg", checked=False)
    assert check_kernel_caches(pkg) is True
    (pkg / "__pycache__" / "kernel.kernel-5.py311.nbi").write_bytes(b"index")
    (pkg / "helper.py").write_text("# changed\n")

    def vanished(root, modules=None):
        raise FileNotFoundError(str(pkg / "helper.py"))

    monkeypatch.setattr(kernel_cache, "kernel_digest", vanished)
    assert check_kernel_caches(pkg) is False  # no error at import, nothing removed yet
    assert cached_files(pkg) == ["kernel.kernel-5.py311.nbi"]
    monkeypatch.undo()
    assert check_kernel_caches(pkg) is True
    assert cached_files(pkg) == []


def _changed_helper(pkg: Path, step: int) -> None:
    (pkg / "helper.py").write_text(
        f"import numba as nb\n\n@nb.njit(inline='always')\ndef step(x):\n    return x + {step}\n"
    )


def test_kernels_cached_outside_the_package_compile_again_when_a_module_changes(tmp_path):
    """``NUMBA_CACHE_DIR`` (and the user-wide folder of a read-only install) hold caches that the
    package's own check cannot clear: the package's digest in each kernel's stamp retires them."""
    pkg = make_package(tmp_path, "checked_pkg", checked=True)
    cache = tmp_path / "numba cache"  # (a space in the path, as users' folders have)
    assert run_kernel(tmp_path, "checked_pkg", cache_dir=cache) == 2
    assert list(cache.rglob("*.nbi")) and not cached_files(pkg)  # cached there, not in the package
    _changed_helper(pkg, 2)
    assert run_kernel(tmp_path, "checked_pkg", cache_dir=cache) == 3
    assert run_kernel(tmp_path, "checked_pkg", cache_dir=cache) == 3


def test_a_package_s_kernels_follow_the_package_they_inline(tmp_path):
    """materialize's kernels inline omicsio_jax's helpers: a change there alone retires them
    (``depends_on``)."""
    base = make_package(tmp_path, "base_pkg", checked=True)
    user = tmp_path / "user_pkg"
    user.mkdir()
    (user / "__init__.py").write_text(
        "import os\nfrom omicsio_jax import check_kernel_caches\nimport base_pkg\n"
        "check_kernel_caches(os.path.dirname(__file__), depends_on=(os.path.dirname(base_pkg.__file__),))\n"
    )
    (user / "kernel.py").write_text(textwrap.dedent(KERNEL.format(pkg="base_pkg")))
    assert run_kernel(tmp_path, "user_pkg") == 2
    _changed_helper(base, 5)
    assert run_kernel(tmp_path, "user_pkg") == 6


def test_a_kernel_with_no_writable_cache_folder_is_cached_in_a_private_temporary_one(tmp_path):
    """No ``NUMBA_CACHE_DIR`` that can be made, no ``__pycache__`` and no home cache to write (a
    locked-down install): numba alone refuses to load the module; its kernels go to a folder of
    the user's own in the temporary directory instead."""
    pkg = make_package(tmp_path, "checked_pkg", checked=True)
    (pkg / "__pycache__").write_text("a file where the folder would be")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where folders would be")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"XDG_CACHE_HOME": str(blocked / "cache"), "HOME": str(blocked), "TMPDIR": str(tmp)}
    assert run_kernel(tmp_path, "checked_pkg", cache_dir=blocked / "numba", env=env) == 2
    (private,) = tmp.glob("omicsio-numba-*")
    assert private.stat().st_mode & 0o777 == 0o700 and list(private.rglob("*.nbi"))
    assert run_kernel(tmp_path, "checked_pkg", cache_dir=blocked / "numba", env=env) == 2


def test_the_private_folder_is_made_in_the_temporary_directory_a_parent_gives(tmp_path):
    """A process whose TMPDIR is a folder of its own, removed when it stops (materialize's pool
    workers), is given its parent's temporary directory in ``OMICSIO_JAX_KERNEL_TMPDIR``: its kernels
    are cached there, found again by the next run's processes."""
    pkg = make_package(tmp_path, "checked_pkg", checked=True)
    (pkg / "__pycache__").write_text("a file where the folder would be")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where folders would be")
    own, parents = tmp_path / "own", tmp_path / "parents"
    own.mkdir()
    parents.mkdir()
    env = {
        "XDG_CACHE_HOME": str(blocked / "cache"),
        "HOME": str(blocked),
        "TMPDIR": str(own),
        "OMICSIO_JAX_KERNEL_TMPDIR": str(parents),
    }
    assert run_kernel(tmp_path, "checked_pkg", cache_dir=blocked / "numba", env=env) == 2
    assert list(own.iterdir()) == []
    (private,) = parents.glob("omicsio-numba-*")
    assert list(private.rglob("*.nbi"))


def test_a_user_cache_folder_that_is_no_absolute_path_is_not_made_in_the_working_directory(tmp_path):
    """Without a home (no ``HOME``, a user id with no password entry: a batch job's) numba's user-wide
    folder is ``~/.cache/numba`` with ``~`` left as it is, as with a relative ``XDG_CACHE_HOME``: numba
    made it under the working directory (a folder named ``~``, one cache per directory a job starts
    in). The kernel goes to the private temporary folder instead."""
    pkg = make_package(tmp_path, "checked_pkg", checked=True)
    (pkg / "__pycache__").write_text("a file where the folder would be")
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    env = {"XDG_CACHE_HOME": "cache", "TMPDIR": str(tmp)}
    assert run_kernel(tmp_path, "checked_pkg", env=env, cwd=work) == 2
    assert list(work.iterdir()) == []
    (private,) = tmp.glob("omicsio-numba-*")
    assert list(private.rglob("*.nbi"))


def test_a_kernel_with_no_folder_to_cache_in_at_all_is_a_one_line_error_naming_the_fix(tmp_path):
    """Nowhere to write and the private temporary folder another's (or open to others): a one-line
    error saying to set NUMBA_CACHE_DIR, not numba's "no locator available" from inside its decorator."""
    pkg = make_package(tmp_path, "checked_pkg", checked=True)
    (pkg / "__pycache__").write_text("a file where the folder would be")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where folders would be")
    tmp = tmp_path / "tmp"
    (tmp / f"omicsio-numba-{os.getuid()}").mkdir(parents=True, mode=0o777)
    (tmp / f"omicsio-numba-{os.getuid()}").chmod(0o777)
    env = {"XDG_CACHE_HOME": str(blocked / "cache"), "HOME": str(blocked), "TMPDIR": str(tmp)}
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_kernel(tmp_path, "checked_pkg", cache_dir=blocked / "numba", env=env)
    last = failed.value.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "omicsio_jax.core.errors.OmicsIOError: no folder to cache the compiled kernels of "
    )
    assert last.endswith("set NUMBA_CACHE_DIR to a folder you can write")


def test_the_locators_find_numbas_classes_under_their_older_names(monkeypatch):
    """numba before 0.62 names its locators ``_UserProvidedCacheLocator`` and so on (the package
    allows numba 0.60): the stamped locators take those."""
    from numba.core import caching

    from omicsio_jax.core import kernel_locators

    cls = getattr(caching, "UserProvidedCacheLocator", None) or caching._UserProvidedCacheLocator
    monkeypatch.delattr(caching, "UserProvidedCacheLocator", raising=False)
    monkeypatch.setattr(caching, "_UserProvidedCacheLocator", cls, raising=False)
    assert kernel_locators._numba_locator("UserProvidedCacheLocator") is cls


def test_no_folder_to_cache_in_names_why_the_private_one_is_not_there(tmp_path, monkeypatch):
    """Where no temporary directory can be written at all (a read-only container), the error says so:
    it said the private folder was "not a folder of this user's alone", a folder that did not exist."""
    import tempfile

    from omicsio_jax.core import kernel_locators

    def no_temporary_directory():
        raise FileNotFoundError(2, "No usable temporary directory found")

    source = tmp_path / "kernel.py"
    source.write_text("")
    monkeypatch.setattr(kernel_locators, "_package_stamp", lambda py_file: "digest")
    monkeypatch.setattr(tempfile, "gettempdir", no_temporary_directory)
    with pytest.raises(OmicsIOError) as refused:
        kernel_locators._Refused.from_function(None, str(source))
    message = str(refused.value)
    assert "no temporary directory can be written for omicsio-numba-" in message
    assert "alone" not in message and "\n" not in message
