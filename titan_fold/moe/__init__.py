"""Mixture-of-experts layer: router, grouped experts, EP x ETP token dispatcher."""

from titan_fold.moe.args import MoEArgs
from titan_fold.moe.dispatcher import TokenDispatcher, install_dispatcher
from titan_fold.moe.experts import GroupedExperts
from titan_fold.moe.layer import MoE, moe_stats
from titan_fold.moe.router import Router, update_expert_bias

__all__ = [
    "MoE", "MoEArgs", "Router", "GroupedExperts", "TokenDispatcher",
    "moe_stats", "update_expert_bias", "install_dispatcher",
]
