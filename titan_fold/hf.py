"""`python -m titan_fold.hf import|export`: convert between Hugging Face and DCP checkpoints (checkpoint/hf.py)."""

from titan_fold.checkpoint.hf import main
from titan_fold.common.errors import run_command

if __name__ == "__main__":
    run_command(main)
