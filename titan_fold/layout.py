"""`python -m titan_fold.layout`: print the folded attention and expert groups of a layout (planning/layout.py)."""

from titan_fold.common.errors import run_command
from titan_fold.planning.layout import main

if __name__ == "__main__":
    run_command(main)
