"""Settings of one MoE layer: the router, token dropping and the expert shapes.

The `[moe]` section of a job config fills the router and capacity fields; a model
flavor fills the shapes. Nothing here knows about parallelism.
"""

from dataclasses import dataclass
from typing import Literal

from titan_fold.common.moe_config import EpOverlap, ExpertKernels
from titan_fold.moe.activation import ExpertActivation


@dataclass
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    moe_ffn_dim: int = 64  # width of one routed expert
    shared_ffn_dim: int = 0  # width of the shared expert; 0 = none
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w_gate) scales the shared expert
    # run the shared expert while the routed tokens are exchanged (Megatron-Core's
    # --moe-shared-expert-overlap); False: before the routed experts
    shared_expert_overlap: bool = True
    # the routed experts' activation of their (gate, up) pairs (moe/activation.py), and biases
    # on their w13 and w2 (GPT-OSS)
    activation: ExpertActivation = ExpertActivation()
    expert_biases: bool = False
    router_bias: bool = False  # a bias on the router's logits (GPT-OSS)

    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = False  # renormalize the k chosen probabilities to sum to 1
    # group-limited routing (DeepSeek-V3; Megatron-Core's --moe-router-num-groups / -group-topk):
    # the experts form num_groups equal groups (consecutive ids), a token picks its top_k
    # experts among the group_topk groups with the highest sum of their two best scores.
    # Groups = the experts of one node's EP ranks makes it node-limited routing.
    num_groups: int = 1
    group_topk: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the combine weights (after norm_topk_prob)

    # None = dropless; otherwise capacity = ceil(tokens * top_k * capacity_factor / num_experts)
    capacity_factor: float | None = None
    pad_to_capacity: bool = False  # every expert gets exactly `capacity` slots: static shapes
    drop_policy: Literal["probs", "position"] = "probs"
    drop_scope: Literal["sub_sequence", "full_sequence"] = "sub_sequence"

    load_balance: Literal["aux_loss", "seq_aux_loss", "aux_free", "none"] = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    aux_free_bias_update_rate: float = 1e-3

    # multiply the routing probability into the activation before w2, so the router's
    # gradient needs no saved expert output (as Megatron-Core does); False = after w2
    prob_before_w2: bool = True
    # the routed experts' grouped GEMMs (moe/experts.py): "torch", "quack" (moe/quack.py), "fp8"
    # (moe/fp8.py), "auto": QuACK where installed and the rows suit it, else torch
    expert_kernels: ExpertKernels = "auto"
    # what runs under the expert all-to-alls: "wgrad" the experts' weight gradients apart from their
    # input gradients (moe/wgrad.py), "batch" two micro-batches interleaved (parallel/overlap.py), both
    ep_overlap: EpOverlap = "off"
    # the exchange over ep x etp (moe/exchange.py): "exact" (split sizes read on the host),
    # "static" (dropless: every peer gets a worst-case block of rows, no host sync; ep x the
    # bytes sent), "device" (dropless over ep: the real rows, split sizes on the device), "auto"
    exchange: Literal["auto", "exact", "static", "device"] = "auto"
    # with exchange = "static": the experts' saved activations keep only their real rows, in one
    # pool of this many rows shared by the layers (moe/stash.py); 0 = off
    stash_rows: int = 0
    # every ep rank runs copies of the call's this many busiest experts (moe/replicas.py); 0 = off
    hot_expert_replicas: int = 0
    # routing replay (moe/replay.py): "off" the router chooses; "rollout" (R3) and "recorded" (R2)
    # the layer takes the expert ids it is given, the combine weights the scores at those ids
    routing_replay: Literal["off", "rollout", "recorded"] = "off"

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
