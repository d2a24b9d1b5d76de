"""Loss curves of a bench/train_step.py record, one line per case: `python -m bench.curves RECORD --out PNG`.

    python -m bench.curves bench/results/muon_h200x2_2026-11-28_1628_curves.json \\
        --out docs/img/muon_vs_adamw_200.png --smooth 10
"""

import argparse
import json


def curves(record: dict, smooth: int) -> dict[str, list[float]]:
    """{case: losses}, each averaged over a trailing window of `smooth` steps (1 = raw)."""
    out = {}
    for row in record["figures"]["rows"]:
        losses = row.get("losses") or []
        out[row["case"]] = [
            sum(losses[max(0, i - smooth + 1) : i + 1]) / len(losses[max(0, i - smooth + 1) : i + 1])
            for i in range(len(losses))
        ]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.curves", description=__doc__.split("\n\n")[0])
    p.add_argument("record", help="a bench/train_step.py result JSON")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--smooth", type=int, default=1, help="trailing mean over this many steps")
    a = p.parse_args(argv)
    if a.smooth < 1:
        p.error(f"--smooth {a.smooth}: must be at least 1")
    with open(a.record) as f:
        record = json.load(f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for case, losses in curves(record, a.smooth).items():
        ax.plot(range(1, len(losses) + 1), losses, label=case)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (mean of the last {a.smooth} steps)" if a.smooth > 1 else "loss")
    ax.set_title(
        f"{record['figures'].get('family', '')} {record['figures'].get('proxy_flavor', '')}, {record['env']['device']}"
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
