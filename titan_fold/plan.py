"""`python -m titan_fold.plan`: rank the folded parallel mappings of a model on a cluster (planning/plan.py)."""

from titan_fold.common.errors import run_command
from titan_fold.planning.options import plan_parser


def main(argv: list[str] | None = None) -> int:
    args = plan_parser().parse_args(argv)  # --help and usage errors before torch is imported
    from titan_fold.planning.plan import run

    return run(args)


if __name__ == "__main__":
    run_command(main)
