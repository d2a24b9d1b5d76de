"""The job configs shipped in titan_fold/train_configs/, found by a bare `--job.config_file`
name: `python -m titan_fold.common.packaged_configs [--names]` lists them from the folder, with
each one's model and `[job] description` (README.md and docs/running.md quote it: docs/gen.py).
Importable without torch or torchtitan."""

import sys
import textwrap
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PACKAGED_CONFIGS = Path(__file__).parent.parent / "train_configs"


def names() -> list[str]:
    return sorted(p.name for p in PACKAGED_CONFIGS.glob("*.toml"))


def table() -> str:
    """One line per config: its file name, model family/flavor and description."""
    rows = []
    for name in names():
        with open(PACKAGED_CONFIGS / name, "rb") as f:
            config = tomllib.load(f)
        model = f"{config['model']['name']}/{config['model']['flavor']}"
        rows.append((name, model, config["job"]["description"]))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{n:<{widths[0]}}  {m:<{widths[1]}}  {d}" for n, m, d in rows)


if __name__ == "__main__":
    print(textwrap.fill("  ".join(names()), 96) if sys.argv[1:] == ["--names"] else table())
