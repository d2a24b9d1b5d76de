"""Errors the user can fix, and how every command reports them.

A `UserError` (a config value, a degree, a path, a checkpoint, a dataset) is printed as one
line naming the problem, once (by the first rank when several run), and the command exits
with code 2 and no traceback. Anything else is a bug or a fault and keeps its traceback.
Every command's `if __name__ == "__main__"` goes through `run_command`.
"""

import os
import sys
from collections.abc import Callable


class UserError(Exception):
    """Input the user can fix; the message names the key (or path) and the rule."""

    exit_code = 2


def is_first_rank() -> bool:
    """Rank 0 of the launch (torchrun's RANK), or a plain process."""
    return int(os.environ.get("RANK", "0")) == 0


def report(message: str) -> None:
    if is_first_rank():
        print(f"error: {message}", file=sys.stderr, flush=True)


def run_command(main: Callable[[], int | None]) -> None:
    """Run a command's main; a UserError becomes one line on stderr and exit code 2."""
    try:
        code = main()
    except UserError as e:
        report(str(e))
        sys.exit(e.exit_code)
    sys.exit(code or 0)
