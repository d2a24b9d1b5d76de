"""Routed experts onto the expert mesh: DTensors placed by the plan, and the EP x ETP dispatcher.

Stacked expert weights are laid out as `placement_plan` says (Shard(0) on ep: whole
experts; the ffn dim on etp), and each MoE layer's dispatcher is replaced by one that
exchanges tokens over those groups. Works on a model still on the meta device, before
`to_empty` and `init_weights`.
"""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_fold.moe import MoE
from titan_fold.moe.dispatcher import install_dispatcher
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.placement import EXPERT, expert_placements, placement_plan


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, layout: Layout) -> None:
    plan = placement_plan(model.args, layout)
    present = dict(model.named_parameters())  # a pipeline stage holds only some layers
    for fqn, placed in plan.items():
        if placed.mesh != EXPERT or not placed.dims or fqn not in present:
            continue
        owner_name, name = fqn.rsplit(".", 1)
        owner = model.get_submodule(owner_name)
        param = getattr(owner, name)
        tensor = distribute_tensor(param.data, layout.expert[placed.dims], placed.placements)
        setattr(owner, name, nn.Parameter(tensor, param.requires_grad))
    ep_mesh = layout.expert["ep"] if layout.ep > 1 else None
    etp_mesh = layout.expert["etp"] if layout.etp > 1 else None
    for moe in moe_layers(model):
        install_dispatcher(moe, ep_mesh, etp_mesh)


def expert_slice(w: torch.Tensor, name: str, ep_mesh: DeviceMesh | None = None,
                 etp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """This rank's slice (a view) of a full stacked expert weight experts.<name>, as the
    plan places it: w1, w3 [E, ffn, dim] -> [E/ep, ffn/etp, dim]; w2 -> [E/ep, dim, ffn/etp]."""
    meshes = {d: m for d, m in (("ep", ep_mesh), ("etp", etp_mesh)) if m is not None}
    for (d, mesh), placement in zip(meshes.items(), expert_placements(name, meshes)):
        if w.shape[placement.dim] % mesh.size():
            raise ValueError(f"experts.{name}: dim {placement.dim} of {tuple(w.shape)} does not split {d} = {mesh.size()} ways")
        w = w.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
    return w


def shard_moe(moe: MoE, ep_mesh: DeviceMesh | None = None, etp_mesh: DeviceMesh | None = None,
              seq_mesh: DeviceMesh | None = None, weights_mesh: DeviceMesh | None = None) -> None:
    """One MoE layer on its own (tests, benchmarks): its full expert weights (equal on every
    rank) become this rank's slices, new Parameters (build the optimizer afterwards), and it
    dispatches over ep x etp. weights_mesh: None = plain local tensors; else a mesh whose dims
    are among "ep", "etp" (e.g. the expert mesh["ep", "etp"]): the slices become DTensors
    placed as the plan says, so that FSDP2 and DCP see the global shapes."""
    for name in ("w1", "w2", "w3"):
        full = getattr(moe.experts, name)
        part = expert_slice(full.detach(), name, ep_mesh, etp_mesh).clone()
        if weights_mesh is not None:
            part = DTensor.from_local(part, weights_mesh, expert_placements(name, weights_mesh.mesh_dim_names),
                                      run_check=False)
        setattr(moe.experts, name, nn.Parameter(part, requires_grad=full.requires_grad))
    install_dispatcher(moe, ep_mesh, etp_mesh, seq_mesh)
