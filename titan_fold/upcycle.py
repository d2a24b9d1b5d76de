"""`python -m titan_fold.upcycle`: a dense checkpoint becomes an MoE model's starting point (checkpoint/upcycle.py)."""

from titan_fold.checkpoint.options import upcycle_parser
from titan_fold.common.errors import run_command


def main(argv: list[str] | None = None) -> None:
    args = upcycle_parser().parse_args(argv)  # --help and usage errors before torch is imported
    from titan_fold.checkpoint.upcycle import run

    run(args)


if __name__ == "__main__":
    run_command(main)
