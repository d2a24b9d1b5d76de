"""`python -m titan_fold.layout`: print the folded attention and expert groups of a layout (planning/layout.py)."""

from titan_fold.common.errors import run_command
from titan_fold.planning.options import layout_parser


def main(argv: list[str] | None = None) -> int:
    args = layout_parser().parse_args(argv)  # --help and usage errors before torch is imported
    from titan_fold.planning.layout import run

    return run(args)


if __name__ == "__main__":
    run_command(main)
