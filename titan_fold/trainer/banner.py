"""The lines a real run prints once at start: both meshes, experts per rank (and copies of hot
experts), stages, memory per rank."""

import torch.nn as nn

from titan_fold.parallel.mesh import Layout
from titan_fold.planning.accounting import GIB, parameter_report


def _human(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / 2**20:.2f} MiB"


def memory_line(model_parts: list[nn.Module], job_config) -> str:
    b = parameter_report(model_parts, job_config)["bytes"]
    return (
        f"params {_human(b['params'])}, grads {_human(b['grads'])}, "
        f"optimizer {_human(b['optimizer'])} ({job_config.optimizer.name})"
    )


def banner(
    layout: Layout,
    model_args,
    model_parts: list[nn.Module],
    job_config,
    num_stages: int = 1,
    optimizer_split: str | None = None,
) -> str:
    """What a real run prints once at start (rank 0): both meshes, experts per rank (and the
    copies of hot experts, when on), pipeline stages and this rank's parameter/gradient/optimizer
    memory, as the dry run counts it; with Muon, which parameters take which update
    (MuonOptimizersContainer.split)."""
    att = " x ".join(f"{k} {v}" for k, v in layout.degrees("attention").items())
    exp = " x ".join(f"{k} {v}" for k, v in layout.degrees("expert").items())
    home, copies = model_args.moe.num_experts // layout.ep, model_args.moe.hot_expert_replicas
    return "\n".join(
        [
            f"titan_fold: {job_config.model.name}/{job_config.model.flavor} on {layout.world_size} "
            + ("rank" if layout.world_size == 1 else "ranks"),
            f"  attention mesh (pp, dp_replicate, dp_shard, cp, tp): {att}",
            f"  expert mesh (pp, edp, ep, etp): {exp}; {home} of {model_args.moe.num_experts} experts per rank",
            *(
                [
                    f"  copies of hot experts (moe.hot_expert_replicas): the {copies} busiest experts of each "
                    f"layer call, spread over the ep ranks; {home} + {copies} physical experts per rank"
                ]
                if copies
                else []
            ),
            *(
                [f"  routed experts: torch's grouped GEMMs, not QuACK's (QuACK {carry})"]
                if model_args.moe.grouped_gemm == "auto"
                and (carry := model_args.moe.activation.quack_problem(model_args.moe.expert_biases))
                else []
            ),
            f"  pipeline stages: {num_stages} ({len(model_parts)} on this rank)",
            f"  memory per rank (rank 0): {memory_line(model_parts, job_config)}",
            *([f"  optimizer updates (rank 0): {optimizer_split}"] if optimizer_split else []),
        ]
    )
