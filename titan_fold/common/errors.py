"""Errors the user can fix, and how every command reports them.

A `UserError` (a config value, a degree, a path, a checkpoint, a dataset) is printed as one
line naming the problem, once, and the command exits with code 2 and no traceback. Anything
else is a bug or a fault and keeps its traceback. Every command's `if __name__ == "__main__"`
goes through `run_command`.

Under torchrun every rank runs the same checks and fails the same way. The first rank of the
node to fail prints the line (rank 0 may be stopped by torchrun before it gets there), and
the line also goes into torchrun's error file, so torchrun's own failure summary, which it
prints after any worker exits non-zero, shows that line as the root cause instead of a
Python traceback. That summary cannot be avoided from inside a worker. Under
`python -m titan_fold.run` (run.py) the ranks only fill their error file, and the launcher
prints the first failing rank's line, without a summary.
"""

import json
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn

# torchrun (torch.distributed.elastic) gives each worker an error file to fill when it fails
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# set by `python -m titan_fold.run` for its ranks: it prints the first failing rank's line itself
LAUNCHER_ENV = "TITAN_FOLD_LAUNCHER"


class UserError(Exception):
    """Input the user can fix; the message names the key (or path) and the rule."""

    exit_code = 2


def is_first_rank() -> bool:
    """Rank 0 of the launch (torchrun's RANK), or a plain process."""
    return int(os.environ.get("RANK", "0")) == 0


def _first_to_report() -> bool:
    error_file = os.environ.get(ERROR_FILE_ENV)
    if not error_file:
        return is_first_rank()
    # torchrun's layout: <attempt folder>/<local rank>/error.json, the attempt folder removed at
    # exit; the first worker to create the marker there prints
    marker = os.path.join(os.path.dirname(os.path.dirname(error_file)), "user_error_reported")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return is_first_rank()
    return True


def _write_error_file(error: UserError) -> None:
    """The error in torchrun's error-file format, with the one line in place of a traceback;
    "line" and "time_ns" (when it failed, finer than torchrun's seconds) for run.py."""
    line = f"{type(error).__name__}: {error}"
    now = time.time_ns()
    data = {
        "message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(now // 10**9)}},
        "line": f"error: {error}",
        "time_ns": now,
    }
    with open(os.environ[ERROR_FILE_ENV], "w") as f:
        json.dump(data, f)


def report(error: UserError) -> None:
    if os.environ.get(ERROR_FILE_ENV):
        _write_error_file(error)
        if os.environ.get(LAUNCHER_ENV):
            return  # the launcher prints the first failing rank's line
    if _first_to_report():
        print(f"error: {error}", file=sys.stderr, flush=True)


def run_command(main: Callable[[], int | None], end: Callable[[int], NoReturn] = sys.exit) -> None:
    """Run a command's main; a UserError becomes one line on stderr and exit code 2. `end(code)`
    ends the process (a bug's traceback ends it as Python does)."""
    try:
        code = main()
    except UserError as e:
        report(e)
        end(e.exit_code)
    except Exception as e:
        if os.environ.get(ERROR_FILE_ENV):
            # a bug: torchrun's failure summary shows its traceback (what torch's @record does)
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(e)
        raise
    end(code or 0)
