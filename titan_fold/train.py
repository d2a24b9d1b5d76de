"""The training command: trains (trainer/), or dry-runs the job at NGPU ranks on one CPU with `--comm.mode fake_backend` (dryrun/).

python -m titan_fold.run --nproc_per_node N --job.config_file FILE.toml [--section.key value ...]
starts it on each rank (run.py), as `torchrun --nproc_per_node N -m titan_fold.train ...` does.
"""

import contextlib
import io
import os
import sys
from pathlib import Path

PROG = "python -m titan_fold.train"
# job_config_help's text, written by docs/gen.py: `--help` alone prints it without importing
# torch or torchtitan
HELP_FILE = Path(__file__).with_name("train_help.txt")
# job_config_keys' lines, written by docs/gen.py: an unknown `--section.key` is refused from it
# without importing torch or torchtitan
KEYS_FILE = Path(__file__).with_name("train_keys.txt")


def job_config_help() -> str:
    """What tyro prints for `python -m titan_fold.train --help` on an 80-column terminal."""
    from torchtitan.config import ConfigManager

    from titan_fold.common.config import JobConfig

    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # tyro draws its boxes for a UTF-8 stream
    argv0, columns = sys.argv[0], os.environ.get("COLUMNS")
    sys.argv[0], os.environ["COLUMNS"] = PROG, "80"  # tyro's prog and width
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            ConfigManager(JobConfig).parse_args(["--help"])
    finally:
        sys.argv[0] = argv0
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    out.flush()
    return out.buffer.getvalue().decode()


def job_config_keys() -> str:
    """Every `section.key` the command takes and its type, one per line: "key<TAB>type"."""
    from titan_fold.common.config import JobConfig, _field, _keys
    from titan_fold.common.values import hint_text

    return "".join(f"{key}\t{hint_text(_field(JobConfig, key))}\n" for key in _keys(JobConfig))


def usage_problem(args: list[str]) -> str | None:
    """The line the full checks give for a config file that is not there, the first `--section.key
    value` that names no key or whose value does not have the key's type (read from KEYS_FILE),
    or no config file at all; None if none of these."""
    from titan_fold.common.values import ConfigError, _resolve_config_arg, check_cli, no_config_file, parse_hint

    hints = dict(line.split("\t") for line in KEYS_FILE.read_text(encoding="utf-8").splitlines())
    try:
        args, path = _resolve_config_arg(args)  # a config file that is not there
        named = check_cli(args, lambda key: parse_hint(hints[key]) if key in hints else None, lambda: list(hints))
    except ConfigError as e:
        return str(e)
    return no_config_file() if path is None and "model.name" not in named else None


def main(args: list[str] | None = None) -> int:
    from titan_fold import dryrun
    from titan_fold.trainer import fold_trainer

    return fold_trainer.main(args, dry_run=dryrun.main)


if __name__ == "__main__":
    if sys.argv[1:] in (["--help"], ["-h"]):
        sys.stdout.write(HELP_FILE.read_text(encoding="utf-8"))
        sys.exit(0)
    sys.argv[0] = PROG  # tyro's usage line; torchtitan's ConfigManager passes no prog
    from titan_fold.common.errors import UserError, report, run_command

    if (problem := usage_problem(sys.argv[1:])) is not None:  # before the seconds of torch's import
        report(UserError(problem))
        sys.exit(2)
    from titan_fold.trainer import fold_trainer

    run_command(main, end=fold_trainer.end_process)
