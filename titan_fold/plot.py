"""`python -m titan_fold.plot DUMP_FOLDER ...`: one PNG of a run's metrics (trainer/plot.py)."""

from titan_fold.common.errors import run_command
from titan_fold.trainer.plot import main

if __name__ == "__main__":
    run_command(main)
