"""`python -m titan_fold.plan`: rank the folded parallel mappings of a model on a cluster (planning/plan.py)."""

from titan_fold.common.errors import run_command
from titan_fold.planning.plan import main

if __name__ == "__main__":
    run_command(main)
