"""Parameter groups by what each part of the model computes, from a parameter's name.

A folding places each group differently (the routed experts on the expert mesh, attention
over tp, the embedding and head over dp), so a bug in one folding shows in one group's
numbers; a model-wide norm hides a group that is small beside the rest. The trainer logs a
norm per group (`metrics.group_grad_norms`), and the equivalence tests compare each group
with the one-rank run.
"""

import re

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
