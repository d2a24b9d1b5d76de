"""`python -m titan_fold.layout`: print the folded attention and expert groups of a layout.

It builds the trainer's own meshes (`titan_fold.parallel.mesh.Layout`) on the fake process
group in this process, so what it prints is what the trainer uses, not a second copy of the
arithmetic. Formats: json (every group of every dim), table (per rank, and which groups cross
a node boundary with --gpus-per-node), png (rank grid by node, like the paper's Figure 1).

    python -m titan_fold.layout --world-size 8 --cp 8 --ep 8 --format table --gpus-per-node 8
"""

import argparse
import dataclasses
import json
import os
import sys

import torch.distributed as dist

from titan_fold.common.config import Parallelism
from titan_fold.common.errors import UserError
from titan_fold.common.pyplot import pyplot
from titan_fold.parallel.mesh import Layout, LayoutError
from titan_fold.parallel.pipeline import format_stages, stage_fqns
from titan_fold.parallel.placement import format_plan, placement_plan

ATTENTION_GROUPS = ("pp", "dp", "cp", "tp", "dp_cp")
EXPERT_GROUPS = ("pp", "edp", "ep", "etp", "ep_etp")
PNG_COMMAND = "python -m titan_fold.layout --format png"


def _model_args(spec: str):
    from titan_fold.models import FLAVORS
    from titan_fold.planning.sizes import resolve_flavor

    family, flavor = resolve_flavor(spec)
    return FLAVORS[family][flavor]


def build_layout(args: argparse.Namespace, model_args=None) -> Layout:
    """Validate (no process group yet), then build both meshes on a fake world as rank 0."""
    layout = Layout(
        args.world_size,
        pp=args.pp,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        cp=args.cp,
        tp=args.tp,
        ep=args.ep,
        etp=args.etp,
        edp=args.edp,
    )
    if model_args is not None:
        layout.validate_model(model_args, getattr(args, "seq_len", None))
    if not dist.is_initialized():
        from titan_fold.compat.dispatch import fake_store

        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=args.world_size)
    layout.build_mesh("cpu")
    return layout


def report(layout: Layout) -> dict:
    return {
        "world_size": layout.world_size,
        "attention": {
            "degrees": layout.degrees("attention"),
            "groups": {n: layout.groups(n, "attention") for n in ATTENTION_GROUPS},
        },
        "expert": {
            "degrees": layout.degrees("expert"),
            "groups": {n: layout.groups(n, "expert") for n in EXPERT_GROUPS},
        },
    }


def _group_index(groups: list[list[int]], world_size: int) -> list[int]:
    index = [0] * world_size
    for i, g in enumerate(groups):
        for r in g:
            index[r] = i
    return index


def _crosses(group: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in group}) > 1


def _short(group: list[int], k: int = 8) -> str:
    return "(" + ",".join(map(str, group[:k])) + (",..." if len(group) > k else "") + ")"


def table(rep: dict, gpus_per_node: int | None = None) -> str:
    w = rep["world_size"]
    dims = [("attention", n) for n in ATTENTION_GROUPS] + [("expert", n) for n in EXPERT_GROUPS if n != "pp"]
    groups = {d: rep[d[0]]["groups"][d[1]] for d in dims}
    lines = [
        f"world_size {w}"
        + (f", {gpus_per_node} GPUs per node, {-(-w // gpus_per_node)} node(s)" if gpus_per_node else ""),
        "attention: " + " ".join(f"{k}={v}" for k, v in rep["attention"]["degrees"].items()),
        "expert:    " + " ".join(f"{k}={v}" for k, v in rep["expert"]["degrees"].items()),
        "",
        "groups (size x count; crossing = groups that span more than one node):",
    ]
    crossing = {}
    for (mesh, name), gs in groups.items():
        label = f"{mesh[:3]}.{name}"
        crossing[(mesh, name)] = {i for i, g in enumerate(gs) if gpus_per_node and _crosses(g, gpus_per_node)}
        cross = f"  crossing {len(crossing[(mesh, name)])}/{len(gs)}" if gpus_per_node else ""
        shown = " ".join(_short(g) for g in gs[:4]) + (" ..." if len(gs) > 4 else "")
        lines.append(f"  {label:<12} {len(gs[0]):>5} x {len(gs):<5}{cross:<18}  {shown}")
    lines += ["", "per rank: group number of each dim (index in the json lists; * = crosses a node)"]
    header = ["rank"] + (["node"] if gpus_per_node else []) + [f"{m[:3]}.{n}" for m, n in dims]
    widths = [max(len(h), 5) for h in header]
    lines.append("  ".join(h.rjust(wd) for h, wd in zip(header, widths, strict=True)))
    index = {d: _group_index(gs, w) for d, gs in groups.items()}
    for r in range(w):
        row = [str(r)] + ([str(r // gpus_per_node)] if gpus_per_node else [])
        row += [f"{index[d][r]}{'*' if index[d][r] in crossing[d] else ''}" for d in dims]
        lines.append("  ".join(c.rjust(wd) for c, wd in zip(row, widths, strict=True)))
    return "\n".join(lines) + "\n"


def png(rep: dict, out: str, gpus_per_node: int | None = None) -> None:
    import numpy as np

    plt = pyplot(PNG_COMMAND)

    w = rep["world_size"]
    per_node = gpus_per_node or min(w, 8)
    nodes = -(-w // per_node)
    panels = [
        [("attention", n) for n in ("tp", "cp", "dp", "dp_cp", "pp")],
        [("expert", n) for n in ("etp", "ep", "ep_etp", "edp", "pp")],
    ]
    cell = 0.32 if w <= 64 else 0.12
    fig, axes = plt.subplots(
        2, 5, figsize=(5 * max(per_node * cell, 1.6) + 1, 2 * max(nodes * cell, 0.8) + 1.4), squeeze=False
    )
    cmap = plt.get_cmap("tab20")
    for row, panel in enumerate(panels):
        for col, (mesh, name) in enumerate(panel):
            ax = axes[row][col]
            gs = rep[mesh]["groups"][name]
            grid = np.full((nodes, per_node), np.nan)
            idx = _group_index(gs, w)
            for r in range(w):
                grid[r // per_node, r % per_node] = idx[r] % 20
            if len(gs[0]) == 1:  # degree 1: every rank alone, nothing to show
                grid[~np.isnan(grid)] = 0
                ax.imshow(grid, cmap="Greys", vmin=0, vmax=8, aspect="equal")
            else:
                ax.imshow(grid, cmap=cmap, vmin=0, vmax=19, aspect="equal", interpolation="nearest")
            if w <= 64:
                for r in range(w):
                    ax.text(r % per_node, r // per_node, str(r), ha="center", va="center", fontsize=6)
            ax.set_title(f"{mesh} {name} = {len(gs[0])}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks(range(nodes) if nodes <= 16 else [])
            ax.set_yticklabels([f"node {i}" for i in range(nodes)] if nodes <= 16 else [], fontsize=6)
    deg = lambda m: " ".join(f"{k}{v}" for k, v in rep[m]["degrees"].items())  # noqa: E731
    fig.suptitle(f"world {w}: attention {deg('attention')} | expert {deg('expert')}  (color = group)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """`python -m titan_fold.layout`'s work, its options parsed (options.layout_parser)."""
    if args.placements and args.model is None:
        raise UserError("--placements needs --model")
    if args.hot_expert_replicas < 0:
        raise UserError(f"--hot-expert-replicas {args.hot_expert_replicas}: must be >= 0")
    if args.format == "png":
        pyplot(PNG_COMMAND)  # the plot extra, before any work
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise UserError(f"--out {args.out}: the folder {os.path.dirname(os.path.abspath(args.out))} does not exist")
    try:
        model_args = _model_args(args.model) if args.model else None
        if model_args is not None and args.hot_expert_replicas:
            moe = dataclasses.replace(model_args.moe, hot_expert_replicas=args.hot_expert_replicas)
            model_args = dataclasses.replace(model_args, moe=moe)
        layout = build_layout(args, model_args)
        stages = None
        if args.placements and layout.pp > 1:
            assert model_args is not None  # --placements needs --model (checked above)
            stages = stage_fqns(
                Parallelism(pipeline_parallel_schedule=args.pp_schedule), model_args.n_layers, layout.pp
            )
    except (LayoutError, ValueError) as e:
        raise UserError(str(e)) from None
    if args.hot_expert_replicas and layout.ep == 1:
        # the trainer's rule (common/rules.py), as this tool's options name it
        raise UserError(
            f"--hot-expert-replicas {args.hot_expert_replicas} needs --ep > 1: the copies spread the busiest "
            "experts' rows over the ep ranks, and ep = 1 has one"
        )
    if args.placements:
        text = format_plan(placement_plan(model_args, layout, stages), layout) + "\n"
        if stages is not None:
            text += f"\npipeline stages ({args.pp_schedule}):\n" + format_stages(stages, layout.pp) + "\n"
        return _emit(text, args.out)
    rep = report(layout)
    if args.format == "png":
        out = args.out or "layout.png"
        try:
            png(rep, out, args.gpus_per_node)
        except OSError as e:
            raise UserError(f"--out {out}: cannot write: {e.strerror or e}") from None
        print(out)
        return 0
    text = json.dumps(rep) + "\n" if args.format == "json" else table(rep, args.gpus_per_node)
    return _emit(text, args.out)


def _emit(text: str, out: str | None) -> int:
    if out:
        try:
            with open(out, "w") as f:
                f.write(text)
        except OSError as e:
            raise UserError(f"--out {out}: cannot write: {e.strerror or e}") from None
    else:
        sys.stdout.write(text)
    return 0
