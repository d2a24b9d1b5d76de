"""tests/conftest.py fails a session with a skip whose reason is not "needs a GPU" or "needs QuACK":
pytest in a subprocess on planted test files, with and without pytest-xdist's workers."""

import os
import subprocess
import sys

import pytest
from conftest import ALLOWED_SKIPS  # the module under test: its skip policy

TESTS = os.path.dirname(os.path.abspath(__file__))

ALLOWED = f'''
import pytest

def test_gpu_kernel():
    pytest.skip("{ALLOWED_SKIPS[0]}: planted")

@pytest.mark.skipif(True, reason="{ALLOWED_SKIPS[1]}: planted")
def test_quack_kernel():
    pass

@pytest.mark.xfail(strict=True, reason="an expected failure is not a skip")
def test_known_failure():
    assert False

def test_runs():
    pass
'''
MISSING_FILE = """
import pytest

def test_reads_data():
    pytest.skip("data file missing")
"""
MISSING_MODULE = """
import pytest

pytest.importorskip("a_module_nobody_installed")

def test_uses_it():
    pass
"""


# the planted files' conftest: the suite's skip hooks (the suite's conftest.py itself loaded under
# another name, as two modules named conftest cannot both be imported)
CONFTEST = f"""
import importlib.util

spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(TESTS, "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_runtest_logreport = suite.pytest_runtest_logreport
pytest_collectreport = suite.pytest_collectreport
pytest_sessionfinish = suite.pytest_sessionfinish
pytest_terminal_summary = suite.pytest_terminal_summary
"""


def _pytest(folder, *args):
    (folder / "pytest.ini").write_text("[pytest]\n")  # not the repository's addopts
    (folder / "conftest.py").write_text(CONFTEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(folder / "pytest.ini"),
            "--rootdir",
            str(folder),
            "-q",
            "-p",
            "no:cacheprovider",
            *args,
            str(folder),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=folder,
    )


def test_allowed_skips_and_xfail_pass(tmp_path):
    (tmp_path / "test_allowed.py").write_text(ALLOWED)
    result = _pytest(tmp_path, "-n", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 2 skipped, 1 xfailed" in result.stdout, result.stdout


@pytest.mark.parametrize("workers", ["0", "2"])
def test_other_skips_fail_the_session(tmp_path, workers):
    (tmp_path / "test_allowed.py").write_text(ALLOWED)
    (tmp_path / "test_missing_file.py").write_text(MISSING_FILE)
    (tmp_path / "test_missing_module.py").write_text(MISSING_MODULE)
    result = _pytest(tmp_path, "-n", workers)
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    summary = result.stdout.split("skips that are not allowed", 1)[-1]
    assert "test_missing_file.py::test_reads_data: data file missing" in summary, result.stdout
    assert "test_missing_module.py: could not import 'a_module_nobody_installed'" in summary, result.stdout
    assert "planted" not in summary, result.stdout
