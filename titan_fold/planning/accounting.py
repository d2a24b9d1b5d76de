"""What a rank's parameters, gradients and optimizer states take, by parameter kind: for the trainer's banner and the dry run."""

import math

import torch
import torch.nn as nn

from titan_fold.common.tensors import local, model_fqn
from titan_fold.models.groups import uses_muon

GIB = 1024**3
# optimizer states per parameter, in the parameter's dtype; Muon keeps one (its momentum) for the
# parameters it orthogonalizes (models/groups.py: uses_muon) and AdamW's two for the rest
OPTIMIZER_STATES = {"Adam": 2, "AdamW": 2, "SGD": 0, "Muon": 2}
MUON_STATES = 1
DIFF_NOTE = 0.10  # differences beyond this fraction get an explanation


def bytes_of(dtype_name: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def param_kind(fqn: str) -> str:
    if ".moe.experts." in fqn:
        return "routed experts"
    for key, kind in (
        (".moe.router.", "router"),
        (".moe.shared_expert", "shared expert"),
        (".attention.", "attention"),
        (".feed_forward.", "dense ffn"),
        ("tok_embeddings.", "embedding"),
        ("output.", "output head"),
    ):
        if key in fqn or fqn.startswith(key):
            return kind
    return "norms"


def parameter_report(model_parts: list[nn.Module], job_config) -> dict:
    """Local shapes by kind and the bytes of params, grads and optimizer states of this rank."""
    master = bytes_of(job_config.training.dtype)  # master weights, their gradients and states
    optimizer = job_config.optimizer.name
    states = OPTIMIZER_STATES.get(optimizer, 2)
    kinds: dict[str, dict] = {}
    numel = state_numel = muon_numel = 0
    for part in model_parts:
        for fqn, p in part.named_parameters():
            shape = tuple(local(p).shape)
            n = math.prod(shape)
            numel += n
            plain = model_fqn(fqn)  # the model's own name
            muon = optimizer == "Muon" and uses_muon(plain, p)
            muon_numel += n if muon else 0
            state_numel += n * (MUON_STATES if muon else states)
            k = kinds.setdefault(param_kind(fqn), {"numel": 0, "shapes": {}})
            k["numel"] += n
            name = plain.split(".", 2)[-1] if plain.startswith("layers.") else plain
            k["shapes"].setdefault(name, shape)
    return {
        "numel": numel,
        "bytes": {"params": numel * master, "grads": numel * master, "optimizer": state_numel * master},
        "kinds": kinds,
        "muon_numel": muon_numel,
    }
