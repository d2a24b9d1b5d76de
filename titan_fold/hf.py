"""`python -m titan_fold.hf import|export`: convert between Hugging Face and DCP checkpoints (checkpoint/hf.py)."""

from titan_fold.checkpoint.options import hf_parser
from titan_fold.common.errors import run_command


def main(argv: list[str] | None = None) -> None:
    args = hf_parser().parse_args(argv)  # --help and usage errors before torch is imported
    from titan_fold.checkpoint.hf import run

    run(args)


if __name__ == "__main__":
    run_command(main)
