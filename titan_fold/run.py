"""The launcher: `python -m titan_fold.train` on every rank, started as torchrun starts it.

    python -m titan_fold.run --nproc_per_node N [torchrun's options] --job.config_file FILE.toml [--section.key value ...]

torchrun's options come first (`--nnodes`, `--rdzv_endpoint`, `--max-restarts`, ...: `python -m
torch.distributed.run --help`), then the trainer's, from the first `--section.key` on. The ranks
are started by torch's elastic agent (torch.distributed.run, what torchrun runs), so restarts,
rendezvous and signals work as under torchrun, and torchrun itself works as before. What
differs is the end of a failed launch:

- bad input: the first failing rank's line `error: ...`, once, and exit code 2 (a usage error
  and `--help` are answered here, before any rank starts);
- a rank that crashed (exit code 1, its traceback above) or was killed by a signal: one line
  `error: rank R ...` after the ranks' output, and that rank's exit code (128 + N for signal N);
- 3 (NaN/Inf stop), 130 (Ctrl-C), 143 (SIGTERM): the ranks' own line, that exit code.

torchrun would add its `ChildFailedError` report and exit 1. Each rank puts its one line in
the error file the agent gives it (common/errors.py; TITAN_FOLD_LAUNCHER tells it not to
print the line itself), and the agent hands those files back with the failures.
"""

import logging
import os
import signal
import sys

from titan_fold import train
from titan_fold.common.errors import LAUNCHER_ENV, UserError, run_command

PROG = "python -m titan_fold.run"
USAGE = (
    f"usage: {PROG} --nproc_per_node N [torchrun's options] --job.config_file FILE.toml [--section.key value ...]\n\n"
    "Runs `python -m titan_fold.train` on N ranks per node, started by torch's elastic agent as\n"
    "torchrun starts them (its options: python -m torch.distributed.run --help). On a failure:\n"
    "the first failing rank's line, once; exit code 2 for bad input. The trainer's options:\n\n"
)
# the exit codes whose line the rank prints itself: bad input (without the launcher), NaN/Inf
# stop, Ctrl-C, SIGTERM/SIGUSR1
SAID_BY_THE_RANK = (2, 3, 130, 143)


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the trainer's): the trainer's start at the first `--section.key`
    (torchrun's option names have no dot) or `--help`."""
    for i, arg in enumerate(args):
        if arg in ("-h", "--help") or (arg.startswith("--") and "." in arg.split("=", 1)[0]):
            return args[:i], args[i:]
    return args, []


def launch_args(launcher: list[str], trainer: list[str]):
    """torchrun's parsed arguments for `-m titan_fold.train TRAINER` with these options; a bad
    option is a UserError."""
    from torch.distributed.run import get_args_parser

    def refuse(message: str):
        raise UserError(f"{message} (torchrun's options: python -m torch.distributed.run --help)")

    parser = get_args_parser()
    parser.prog, parser.error = PROG, refuse
    args = parser.parse_args([*launcher, "--module", "titan_fold.train"])
    if args.training_script != "titan_fold.train" or args.training_script_args or args.no_python or args.run_path:
        raise UserError(
            f"{PROG} runs titan_fold.train itself: give torchrun's options, then the trainer's, "
            f"without a script or -m MODULE (got: {' '.join(launcher)})"
        )
    args.training_script_args = trainer
    return args


def first_failure(failures: dict) -> int:
    """The rank that failed first (failures: ChildFailedError's, rank -> ProcessFailure): of the
    ranks that wrote their line, the earliest by their clock (ns); else the first the agent
    found ended (the failures are in that order: it SIGTERMs the others after the first)."""
    order = list(failures)
    return min(
        order,
        key=lambda r: (
            "line" not in failures[r].error_file_data,
            failures[r].error_file_data.get("time_ns", 0),
            order.index(r),
        ),
    )


def report_failures(failures: dict) -> int:
    """Print the first failing rank's line, or one naming it; -> its exit code."""
    rank = first_failure(failures)
    data, code = failures[rank].error_file_data, failures[rank].exitcode
    if "line" in data:
        print(data["line"], file=sys.stderr, flush=True)
    elif code < 0:
        print(f"error: rank {rank} was killed by {signal.Signals(-code).name}", file=sys.stderr, flush=True)
        return 128 - code
    elif code not in SAID_BY_THE_RANK:
        print(f"error: rank {rank} failed with exit code {code} (its output is above)", file=sys.stderr, flush=True)
    return code


def main(argv: list[str]) -> int:
    launcher, trainer = split_args(argv)
    if any(a in ("-h", "--help") for a in argv):
        sys.stdout.write(USAGE + train.HELP_FILE.read_text(encoding="utf-8"))
        return 0
    if (problem := train.usage_problem(trainer)) is not None:  # once here, not once per rank
        raise UserError(problem)
    args = launch_args(launcher, trainer)  # torch's import: a second or two

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, run

    # the agent's own lines on a failure ("failed (exitcode: 2) ...", "Sending process ... SIGTERM"):
    # the line printed below says it once
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    if "OMP_NUM_THREADS" not in os.environ and determine_local_world_size(args.nproc_per_node) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun sets, without its banner
    os.environ[LAUNCHER_ENV] = "1"  # the ranks leave their line to report_failures
    try:
        run(args)
    except ChildFailedError as e:
        return report_failures(e.failures)
    except SignalException as e:  # the agent stopped the ranks; they have said where they stopped
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    run_command(lambda: main(sys.argv[1:]))
