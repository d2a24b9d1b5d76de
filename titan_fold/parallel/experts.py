"""Routed experts onto the expert mesh: DTensors placed by the plan, and the EP x ETP dispatcher.

Stacked expert weights are laid out as `placement_plan` says (Shard(0) on ep: whole
experts; the ffn dim on etp), and each MoE layer's dispatcher is replaced by one that
exchanges tokens over those groups. Works on a model still on the meta device, before
`to_empty` and `init_weights`.
"""

import torch.nn as nn
from torch.distributed.tensor import distribute_tensor

from titan_fold.moe import MoE
from titan_fold.moe.dispatcher import install_dispatcher
from titan_fold.parallel.layout import Layout
from titan_fold.parallel.plan import EXPERT, placement_plan


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
        install_dispatcher(moe, ep_mesh, etp_mesh, shard_weights=False)
