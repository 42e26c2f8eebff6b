"""With ``CI`` set, a skip in a module that starts real components fails the run (conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    shutil.copy(TESTS / "conftest.py", root / "conftest.py")
    (root / "test_checkpoint.py").write_text(  # a flagship module skipped whole, as by a version clash
        'import pytest\npytest.importorskip("orbax_that_clashes")\n\ndef test_resume():\n    pass\n'
    )
    (root / "test_s3_dataset.py").write_text(  # a flagship test skipping itself
        'import pytest\n\ndef test_read():\n    pytest.skip("no moto")\n\n'
        '@pytest.mark.xfail(reason="known")\ndef test_known():\n    assert False\n'
    )
    (root / "test_plain.py").write_text(  # any other module may skip
        'import pytest\n\ndef test_gpu():\n    pytest.skip("no GPU")\n'
    )
    return root


def _run(root: Path, ci: bool, *only: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "1"} if ci else {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *only],
        cwd=root,
        env={**env, "PYTHONPATH": str(TESTS.parent)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_in_ci_a_flagship_skip_fails_and_others_do_not(suite):
    run = _run(suite, True, "test_s3_dataset.py", "test_plain.py")
    assert run.returncode == 1, run.stdout
    assert "1 failed, 1 skipped, 1 xfailed" in run.stdout, run.stdout
    assert "skipped in CI, where it must run: no moto" in run.stdout


def test_in_ci_a_flagship_module_skipped_whole_fails(suite):
    run = _run(suite, True, "test_checkpoint.py")
    assert run.returncode != 0 and "1 error" in run.stdout, run.stdout
    assert "skipped in CI, where it must run: could not import 'orbax_that_clashes'" in run.stdout


def test_outside_ci_skips_are_skips(suite):
    run = _run(suite, False)
    assert run.returncode == 0, run.stdout
    assert "3 skipped, 1 xfailed" in run.stdout, run.stdout
