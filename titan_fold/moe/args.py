"""Settings of one MoE layer: the `[moe]` keys (common/moe_config.py's MoEKeys) and the expert shapes.

A model flavor fills the shapes and may set any key; the job config's `[moe]` values replace the
keys it sets (models/args.py). Nothing here knows about parallelism.
"""

from dataclasses import dataclass

from titan_fold.common.moe_config import MoEKeys
from titan_fold.moe.activation import ExpertActivation


@dataclass
class MoEArgs(MoEKeys):
    """MoEKeys, described there, and the flavor's shapes and variants, described here."""

    num_experts: int = 8
    """Routed experts."""
    moe_ffn_dim: int = 64
    """Width of one routed expert."""
    shared_ffn_dim: int = 0
    """Width of the shared expert; 0 = none."""
    shared_expert_gate: bool = False
    """Qwen2-MoE: sigmoid(x @ w_gate) scales the shared expert."""
    activation: ExpertActivation = ExpertActivation()
    """The routed experts' activation of their (gate, up) pairs (moe/activation.py)."""
    expert_biases: bool = False
    """Biases on the routed experts' w13 and w2 (GPT-OSS)."""
    router_bias: bool = False
    """A bias on the router's logits (GPT-OSS)."""
    aux_free_bias_update_rate: float = 1e-3
    """load_balance = "aux_free": each expert's bias moves by this after each optimizer step,
    bias_e += rate * sign(mean load - load_e)."""
    prob_before_w2: bool = True
    """Multiply the routing probability into the activation before w2, so the router's gradient
    needs no saved expert output (as Megatron-Core does); False = after w2."""

    def __post_init__(self):
        if self.token_drop != "dropless" and self.capacity_factor is None:
            raise ValueError(f"MoEArgs: token_drop = {self.token_drop!r} needs a capacity_factor")
        if self.token_drop == "dropless" and self.capacity_factor is not None:
            raise ValueError(f"MoEArgs: capacity_factor = {self.capacity_factor} with token_drop = 'dropless'")

    def routing_problem(self) -> str | None:
        """Why the group-limited routing settings cannot route, naming the `[moe]` key; None if they can."""
        E, G = self.num_experts, self.num_groups
        if G < 1 or E % G:
            return f"moe.num_groups = {G}: must divide the {E} experts"
        if not 1 <= self.group_topk <= G:
            return f"moe.group_topk = {self.group_topk}: must be in [1, moe.num_groups = {G}]"
        if self.top_k > self.group_topk * (E // G):
            return (
                f"moe.top_k = {self.top_k}: more than the {self.group_topk * (E // G)} experts of "
                f"moe.group_topk = {self.group_topk} groups of {E // G}"
            )
        return None
