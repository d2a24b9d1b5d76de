"""`python -m titan_fold.upcycle`: a dense checkpoint becomes an MoE model's starting point (checkpoint/upcycle.py)."""

from titan_fold.checkpoint.upcycle import main
from titan_fold.common.errors import run_command

if __name__ == "__main__":
    run_command(main)
