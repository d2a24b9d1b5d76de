"""The lines a real run prints once at start: both meshes, experts per rank (and copies of hot
experts), stages, memory per rank."""

import torch
import torch.nn as nn

from titan_fold.common.config import JobConfig
from titan_fold.common.device import device_type
from titan_fold.models import gdn_fla
from titan_fold.models.args import TransformerArgs
from titan_fold.parallel.mesh import Layout
from titan_fold.planning.accounting import GIB, parameter_report


def _human(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / 2**20:.2f} MiB"


def memory_line(model_parts: list[nn.Module], job_config: JobConfig) -> str:
    b = parameter_report(model_parts, job_config)["bytes"]
    return (
        f"params {_human(b['params'])}, grads {_human(b['grads'])}, "
        f"optimizer {_human(b['optimizer'])} ({job_config.optimizer.name})"
    )


def linear_attention_rule(model_args: TransformerArgs) -> str | None:
    """Which gated delta rule the model's linear-attention layers run here, with the reason when it
    is not fla's kernels (models/gated_deltanet.py); None without such layers."""
    if "linear_attention" not in model_args.layer_types:
        return None
    dk, dv = model_args.linear_key_head_dim, model_args.linear_value_head_dim
    problem = gdn_fla.problem(torch.empty(1, dk, device=device_type()), torch.empty(1, dv, device=device_type()))
    return "fla's CUDA kernels" if problem is None else f"the torch chunked rule ({problem})"


def banner(
    layout: Layout,
    model_args: TransformerArgs,
    model_parts: list[nn.Module],
    job_config: JobConfig,
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
                [
                    f"  routing replay (moe.routing_replay = '{replay}'): the MoE layers take the "
                    + ("data's routed_experts" if replay == "rollout" else "routing a no-grad pass recorded")
                    + "; the router runs its torch path, not the fused Triton kernels, which choose their own"
                ]
                if (replay := model_args.moe.routing_replay) != "off"
                else []
            ),
            *(
                [f"  routed experts: torch's grouped GEMMs, not QuACK's (QuACK {carry})"]
                if model_args.moe.expert_kernels == "auto"
                and (carry := model_args.moe.activation.quack_problem(model_args.moe.expert_biases))
                else []
            ),
            *([f"  linear attention (Gated DeltaNet): {rule}"] if (rule := linear_attention_rule(model_args)) else []),
            f"  pipeline stages: {num_stages} ({len(model_parts)} on this rank)",
            f"  memory per rank (rank 0): {memory_line(model_parts, job_config)}",
            *([f"  optimizer updates (rank 0): {optimizer_split}"] if optimizer_split else []),
        ]
    )
