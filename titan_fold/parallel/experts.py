"""The MoE layers onto the layout: routed experts placed by the plan, and each layer's
dispatcher built with every group it talks to.

Stacked expert weights are laid out as `placement_plan` says (Shard(0) on ep: whole
experts; the ffn dim on etp). Each MoE layer gets one `TokenDispatcher` that knows, from
the start, the ep and etp groups it exchanges tokens over and the attention's cp x tp group
that holds the rest of its sequences (with the cp chunk order), which the router's aux-loss
statistics and full-sequence dropping read. Works on a model still on the meta device,
before `to_empty` and `init_weights`.
"""

import functools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_fold.moe import MoE, MoEArgs, TokenDispatcher, moe_layers
from titan_fold.moe.quack import varying_rows
from titan_fold.moe.stash import Stash
from titan_fold.parallel.attention import sequence_positions
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.placement import EXPERT, Placed, expert_placements


def dispatcher(layout: Layout, args: MoEArgs) -> TokenDispatcher:
    """The dispatcher of an MoE layer under `layout`: all its groups, and its exchange, at once."""
    return TokenDispatcher(
        args,
        ep_mesh=layout.get_optional_mesh("ep"),
        etp_mesh=layout.get_optional_mesh("etp"),
        # aux-loss statistics and full-sequence drop decisions over whole sequences,
        # whatever cp x tp cut them into (cp: in its load-balanced chunk order)
        seq_mesh=layout.get_optional_mesh("cp_tp"),
        seq_positions=functools.partial(sequence_positions, layout.cp, layout.tp) if layout.cp > 1 else None,
    )


def set_dispatcher(moe: MoE, dispatcher: TokenDispatcher) -> None:
    """The layer's dispatcher, and the router's sequence group: the dispatcher's (one source)."""
    moe.dispatcher, moe.seq_mesh = dispatcher, dispatcher.seq_mesh


def apply_moe(model: nn.Module, layout: Layout, plan: dict[str, Placed]) -> None:
    """Routed experts as DTensors on the expert mesh where the plan lays them out on ep / etp;
    every MoE layer's dispatcher for this layout (with moe.stash_rows, sharing one Stash); "auto"
    grouped GEMMs are torch's where the experts' row count varies (moe/quack.py: varying_rows)."""
    for fqn, param in list(model.named_parameters()):  # a pipeline stage holds only some layers
        placed = plan[fqn]
        if placed.mesh != EXPERT or not placed.dims:
            continue
        owner_name, name = fqn.rsplit(".", 1)
        tensor = distribute_tensor(param.data, layout.expert[placed.dims], placed.placements)
        setattr(model.get_submodule(owner_name), name, nn.Parameter(tensor, param.requires_grad))
    stash = None  # moe.stash_rows: one pool for the model part's MoE layers
    etp_mesh = layout.get_optional_mesh("etp")
    etp_rank = etp_mesh.get_local_rank() if etp_mesh is not None else 0
    for moe in moe_layers(model):
        set_dispatcher(moe, dispatcher(layout, moe.args))
        moe.experts.adds_w2_bias = etp_rank == 0  # the etp sum gets w2_bias once
        if moe.experts.grouped_gemm == "auto" and varying_rows(moe.args, layout.ep, layout.etp):
            moe.experts.grouped_gemm = "torch"  # QuACK would tune its kernels in every call
        if moe.args.stash_rows:
            stash = stash or Stash(moe.args.stash_rows)
            moe.dispatcher.stash = stash


def expert_slice(
    w: torch.Tensor, name: str, ep_mesh: DeviceMesh | None = None, etp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """This rank's slice (a view) of a full stacked expert weight experts.<name>, as the
    plan places it: w13 [E, 2 * ffn, dim] -> [E/ep, 2 * ffn/etp, dim]; w2 -> [E/ep, dim, ffn/etp]."""
    meshes = {d: m for d, m in (("ep", ep_mesh), ("etp", etp_mesh)) if m is not None}
    for (d, mesh), placement in zip(meshes.items(), expert_placements(name, meshes), strict=True):
        if not isinstance(placement, Shard):
            continue  # whole on every rank of this dim
        if w.shape[placement.dim] % mesh.size():
            raise ValueError(
                f"experts.{name}: dim {placement.dim} of {tuple(w.shape)} does not split {d} = {mesh.size()} ways"
            )
        w = w.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
    return w


def shard_moe(
    moe: MoE,
    ep_mesh: DeviceMesh | None = None,
    etp_mesh: DeviceMesh | None = None,
    seq_mesh: DeviceMesh | None = None,
    weights_mesh: DeviceMesh | None = None,
) -> None:
    """One MoE layer on its own (tests, benchmarks): its full expert weights (equal on every
    rank) become this rank's slices, new Parameters (build the optimizer afterwards), and it
    dispatches over ep x etp. weights_mesh: None = plain local tensors; else a mesh whose dims
    are among "ep", "etp" (e.g. the expert mesh["ep", "etp"]): the slices become DTensors
    placed as the plan says, so that FSDP2 and DCP see the global shapes."""
    for name in ("w13", "w2", "w13_bias", "w2_bias"):
        full = getattr(moe.experts, name)
        if full is None:  # experts without biases
            continue
        part = expert_slice(full.detach(), name, ep_mesh, etp_mesh).clone()
        if weights_mesh is not None:
            part = DTensor.from_local(
                part, weights_mesh, expert_placements(name, weights_mesh.mesh_dim_names), run_check=False
            )
        setattr(moe.experts, name, nn.Parameter(part, requires_grad=full.requires_grad))
    set_dispatcher(moe, TokenDispatcher(moe.args, ep_mesh, etp_mesh, seq_mesh))
    moe.experts.adds_w2_bias = etp_mesh is None or etp_mesh.get_local_rank() == 0
