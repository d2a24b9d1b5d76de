"""Routed experts onto the expert mesh: (ep, etp) DTensors and the EP x ETP dispatcher.

Stacked expert weights are sharded Shard(0) on ep (whole experts) and on their ffn dim on
etp (w1, w3 [E, ffn, dim]: Shard(1); w2 [E, dim, ffn]: Shard(2)); the MoE layer's
dispatcher is replaced by one that exchanges tokens over those groups. Works on a model
still on the meta device, before `to_empty` and `init_weights`.
"""

import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor

from titan_fold.moe import MoE
from titan_fold.moe.dispatcher import install_dispatcher
from titan_fold.parallel.layout import Layout

# (placement on ep, placement on etp) of each stacked weight
EXPERT_PLACEMENTS = {
    "w1": (Shard(0), Shard(1)),
    "w3": (Shard(0), Shard(1)),
    "w2": (Shard(0), Shard(2)),
}


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, layout: Layout) -> None:
    # the (ep, etp) slice is kept 2-D even when one degree is 1: the parameters' mesh then
    # always names "ep", which is how gradient clipping tells expert from dense parameters
    mesh = layout.expert["ep", "etp"]
    ep_mesh = layout.expert["ep"] if layout.ep > 1 else None
    etp_mesh = layout.expert["etp"] if layout.etp > 1 else None
    seq_mesh = layout.get_optional_mesh("cp_tp") if "cp_tp" in layout.mesh_names() else None
    for moe in moe_layers(model):
        for name, placements in EXPERT_PLACEMENTS.items():
            param = getattr(moe.experts, name)
            setattr(moe.experts, name, nn.Parameter(distribute_tensor(param.data, mesh, placements), param.requires_grad))
        install_dispatcher(moe, ep_mesh, etp_mesh, seq_mesh, shard_weights=False)
