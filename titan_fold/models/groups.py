"""Parameter groups by what each part of the model computes, from a parameter's name.

A folding places each group differently (the routed experts on the expert mesh, attention
over tp, the embedding and head over dp), so a bug in one folding shows in one group's
numbers; a model-wide norm hides a group that is small beside the rest. The trainer logs a
norm per group (`metrics.group_grad_norms`), and the equivalence tests compare each group
with the one-rank run.
"""

import re

import torch

# the first rule whose pattern occurs in a parameter's name decides its group
GROUP_RULES: tuple[tuple[str, str], ...] = (
    ("mtp", r"^mtp\."),
    ("norms", r"norm\.weight$"),
    ("embedding", r"^tok_embeddings\."),
    ("head", r"^output\."),
    ("router", r"\.moe\.router\."),
    ("routed_experts", r"\.moe\.experts\."),
    ("shared_experts", r"\.moe\.shared_expert(_gate)?\."),
    ("dense_ffn", r"\.feed_forward\."),
    ("attention", r"\.attention\."),
)
GROUPS: tuple[str, ...] = tuple(name for name, _ in GROUP_RULES)


def parameter_group(fqn: str) -> str:
    """The group of the parameter named `fqn` (as named_parameters() gives it)."""
    for name, pattern in GROUP_RULES:
        if re.search(pattern, fqn):
            return name
    raise ValueError(f"parameter {fqn}: in no parameter group (models/groups.py)")


# Muon's update (trainer/muon.py) takes a parameter whose name matches one of these and that has
# the dims given; AdamW takes the others (embedding, head, norms, router, shared expert gate, biases)
MUON_RULES: tuple[tuple[str, int], ...] = (
    (r"\.attention\.\w+\.weight$", 2),  # wq wk wv wo; MLA's wq_a wq_b wkv_a wkv_b wk_rope
    (r"\.feed_forward\.w[123]\.weight$", 2),
    (r"\.moe\.shared_expert\.w[123]\.weight$", 2),
    (r"\.moe\.experts\.w(13|2)$", 3),  # a stack of experts
    (r"^mtp\.layers\.\d+\.eh_proj\.weight$", 2),
)


def uses_muon(fqn: str, p: torch.Tensor) -> bool:
    """Whether the parameter named `fqn` takes Muon's update (else AdamW's)."""
    return any(re.search(pattern, fqn) and p.ndim == ndim for pattern, ndim in MUON_RULES)


def matrices(fqn: str, unit: torch.Tensor) -> torch.Tensor:
    """One unit of a Muon parameter (a 2-D weight, or one expert's slice of a stack) -> the
    matrices Muon orthogonalizes, [k, A, B]: w13's gate and up rows apart, else the unit."""
    if fqn.endswith(".experts.w13"):
        return torch.stack([unit[0::2], unit[1::2]])
    return unit.unsqueeze(0)


def from_matrices(fqn: str, stack: torch.Tensor) -> torch.Tensor:
    """`matrices`' inverse: [k, A, B] -> the unit."""
    if fqn.endswith(".experts.w13"):
        return torch.stack([stack[0], stack[1]], dim=1).flatten(0, 1)  # gate, up rows alternating
    return stack[0]


def matrix_shape(fqn: str, shape: torch.Size) -> tuple[int, int]:
    """The [A, B] of the matrices Muon orthogonalizes in a parameter of global `shape`."""
    a, b = shape[-2:]
    return (a // 2, b) if fqn.endswith(".experts.w13") else (a, b)
