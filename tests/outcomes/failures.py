"""What a failed test failed on: a test's assertion about values, or anything else (a crash).

An AssertionError is a test's when the frame that raised it is test code (a file under the
tests folder) or an assertion library (torch.testing.assert_close, numpy.testing): `assert x ==
pytest.approx(y)`, assert_close, a helper's `assert`. An AssertionError raised in titan_fold/
(an invariant such as `assert mesh is not None`) is a crash like any other exception.

A test's ranks (tests/launcher.py) and the Python processes it starts (sitecustomize.py beside
this file) append each exception that ends them to the file $TITAN_FOLD_FAILURE_LOG, one JSON
line each; pytest_outcomes.py reads the lines a test added when it judges that test's failure.
"""

import json
import os
import sys

LOG = "TITAN_FOLD_FAILURE_LOG"  # no such variable: nothing is logged
TEST_CODE = "TITAN_FOLD_TEST_CODE"  # the tests folder (default: the one holding this file)
ASSERTION_LIBRARIES = tuple(os.sep + os.path.join(*p) + os.sep for p in (("torch", "testing"), ("numpy", "testing")))


def raised_at(exc: BaseException) -> tuple[str, int]:
    """(file, line) of the frame that raised exc."""
    tb = exc.__traceback__
    if tb is None:
        return "?", 0
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno


def is_test_assertion(exc: BaseException) -> bool:
    """An AssertionError raised by test code or an assertion library."""
    if not isinstance(exc, AssertionError):
        return False
    path = os.path.abspath(raised_at(exc)[0])
    tests = os.environ.get(TEST_CODE) or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return path.startswith(os.path.join(tests, "")) or any(lib in path for lib in ASSERTION_LIBRARIES)


def describe(exc: BaseException) -> str:
    """`Type: first line of the message (file:line)`, short enough for one line of a report."""
    lines = str(exc).strip().splitlines()
    path, line = raised_at(exc)
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''} ({os.path.basename(path)}:{line})"


def note(kind: str, what: str) -> None:
    """Append {kind: "assertion" | "crash" | "timeout", what, pid} to the log, if there is one."""
    path = os.environ.get(LOG)
    if path:
        # one short write in append mode: lines from several processes do not interleave
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "what": what, "pid": os.getpid(), "argv": sys.argv[:3]}) + "\n")


def note_exception(exc: BaseException) -> None:
    """An exception that ends a process; SystemExit is the process's own exit code, not logged."""
    if not isinstance(exc, SystemExit):
        note("assertion" if is_test_assertion(exc) else "crash", describe(exc))


def install_excepthook() -> None:
    """Log the exception that ends this process (sitecustomize.py calls this at start-up)."""
    previous = sys.excepthook

    def hook(kind, exc, tb):
        try:
            note_exception(exc.with_traceback(tb))
        finally:
            previous(kind, exc, tb)

    sys.excepthook = hook


def read_log(path: str, start: int) -> list[dict]:
    """The log's lines from byte `start` on."""
    try:
        with open(path) as f:
            f.seek(start)
            return [json.loads(line) for line in f.read().splitlines() if line.strip()]
    except FileNotFoundError:
        return []
