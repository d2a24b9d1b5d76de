"""Mixture-of-experts layer: router, grouped experts, EP x ETP token dispatcher."""

from titan_fold.moe.args import MoEArgs
from titan_fold.moe.dispatcher import TokenDispatcher
from titan_fold.moe.experts import GroupedExperts
from titan_fold.moe.layer import (
    FeedForward,
    MoE,
    moe_layers,
    moe_stats,
    moe_stats_from,
    moe_stats_values,
    update_expert_bias,
)
from titan_fold.moe.router import Router

__all__ = [
    "MoE",
    "MoEArgs",
    "Router",
    "GroupedExperts",
    "TokenDispatcher",
    "FeedForward",
    "moe_layers",
    "moe_stats",
    "moe_stats_from",
    "moe_stats_values",
    "update_expert_bias",
]
