"""The training command: trains (trainer/), or dry-runs the job at NGPU ranks on one CPU with `--comm.mode fake_backend` (dryrun/).

    torchrun --nproc_per_node N -m titan_fold.train --job.config_file FILE.toml [--section.key value ...]
"""

import sys

from titan_fold import dryrun
from titan_fold.common.errors import run_command
from titan_fold.trainer import fold_trainer


def main(args: list[str] | None = None) -> int:
    return fold_trainer.main(args, dry_run=dryrun.main)


if __name__ == "__main__":
    sys.argv[0] = "python -m titan_fold.train"  # tyro's usage line; torchtitan's ConfigManager passes no prog
    run_command(main, end=fold_trainer.end_process)
