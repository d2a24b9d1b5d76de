"""matplotlib for the commands that draw (`python -m titan_fold.plot`, `python -m
titan_fold.layout --format png`): an optional dependency (the plot extra), so its absence is
one line saying how to install it, not an import traceback."""

from titan_fold.common.errors import UserError


def pyplot(command: str):
    """matplotlib.pyplot drawing to files only (the Agg backend); without matplotlib, a
    UserError: `COMMAND needs matplotlib: pip install -e ".[plot]"`."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UserError(f'{command} needs matplotlib: pip install -e ".[plot]"') from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt
