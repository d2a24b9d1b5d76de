"""The decoder-only MoE transformer (Qwen2-MoE, Qwen3-MoE and Mixtral flavors)."""

from titan_fold.models.args import TransformerArgs
from titan_fold.models.flavors import FLAVORS
from titan_fold.models.transformer import Transformer

__all__ = ["FLAVORS", "Transformer", "TransformerArgs"]
