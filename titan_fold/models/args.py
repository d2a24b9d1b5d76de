"""Shape and routing settings of the decoder-only MoE transformer (Qwen2-MoE, Qwen3-MoE, Mixtral).

A flavor (flavors.py) fills every field; the job config then sets the sequence length and
any `[moe]` value the user chose. Parameter and FLOP counts for MFU live here too, because
the trainer asks the model args for them.
"""

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn
from torchtitan.protocols.model import BaseModelArgs

from titan_fold.common.moe_config import MovedMoEKeys
from titan_fold.models.layers import rope_cos_sin
from titan_fold.moe import MoEArgs

# a layer's token mixer (transformers' config `layer_types`); transformer.MIXERS builds each
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


@dataclass
class TransformerArgs(BaseModelArgs):
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads // n_kv_heads query heads share one K/V head
    # None = dim // n_heads, filled in at construction: dataclasses.replace(args, dim=...) keeps
    # the old value, so pass head_dim=None with a new dim or n_heads
    head_dim: int = None  # type: ignore[assignment]  # an int once __post_init__ has run
    vocab_size: int = 512
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    qkv_bias: bool = False  # Qwen2 has biases on wq, wk, wv
    out_bias: bool = False  # a bias on wo too (Qwen3's attention_bias puts one on all four)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
    max_seq_len: int = 2048  # RoPE table length; the job's training.seq_len replaces it

    # attention variants (models/attention.py)
    attention_sinks: bool = False  # GPT-OSS: one learned sink logit per head joins the softmax
    sliding_window: int | None = None  # keys a "sliding_attention" layer's query sees, itself included
    attention_output_gate: bool = False  # Qwen3.5: wq gives each head a gate, out * sigmoid(gate)
    partial_rotary_factor: float = 1.0  # RoPE on this share of head_dim (the first dims)
    # one of LAYER_TYPES per layer (transformers' layer_types); () = every layer full_attention
    layer_types: tuple[str, ...] = ()

    # Layer i is MoE when i >= first_k_dense and i % moe_layer_freq == 0 (Megatron-Core's
    # and DeepSeek's convention; 1 = every layer) and i is not in dense_layers (HF's
    # mlp_only_layers and decoder_sparse_step, spelled out). Other layers use a dense
    # SwiGLU of ffn_dim.
    ffn_dim: int = 256
    moe_layer_freq: int = 1
    first_k_dense: int = 0
    dense_layers: tuple[int, ...] = ()

    tie_embeddings: bool = False  # output head reuses tok_embeddings.weight
    moe: MoEArgs = field(default_factory=MoEArgs)
    # Multi-Token Prediction (models/mtp.py): mtp_layers extra blocks after the last one, each
    # predicting one token further ahead; their loss enters backward times mtp_loss_scaling_factor
    mtp_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq={self.moe_layer_freq} must be >= 1")
        self.layer_types = tuple(self.layer_types)
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}")
        if unknown := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"layer_types: unknown {unknown}; known: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers: set sliding_window")

    def layer_type(self, layer_id: int) -> str:
        """The token mixer of layer layer_id (an MTP layer's, past n_layers: full_attention)."""
        return self.layer_types[layer_id] if layer_id < len(self.layer_types) else "full_attention"

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer layer_id's attention, None where it sees every earlier key."""
        return self.sliding_window if self.layer_type(layer_id) == "sliding_attention" else None

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones): head_dim x partial_rotary_factor."""
        return int(self.head_dim * self.partial_rotary_factor)

    def attention_module(self) -> nn.Module | None:
        """The attention of one block; None: transformer.Attention (grouped-query attention)."""
        return None

    def rope_tables(self, device=None):
        """(cos, sin) [max_seq_len, rotated dims], float32, half-split layout."""
        return rope_cos_sin(self.rotary_dim, self.max_seq_len, self.rope_theta, device)

    def attention_flops_dim(self) -> float:
        """Per head: the mean of the q.k and the p.v widths (the attention-score FLOPs' factor)."""
        return self.head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            layer_id >= self.first_k_dense and layer_id % self.moe_layer_freq == 0 and layer_id not in self.dense_layers
        )

    def n_moe_layers(self) -> int:
        """The model's MoE layers (routing replay's routed_experts has one column per layer, in order)."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def update_from_config(self, job_config, **kwargs) -> None:
        """Take the job's sequence length and every `[moe]` value that is set (not None): the
        flavor's keys the user set, and the job's keys (common/moe_config.py); the moved keys were
        read into their new keys (common/rules.py).

        This changes self: the train specs hand out copies of the flavors (FlavorCopies),
        so FLAVORS stays untouched. A `[moe]` key that MoEArgs does not have raises TypeError.
        """
        seq_len, model = job_config.training.seq_len, getattr(job_config, "model", None)
        # the model's own context length, before the job's replaces it, unless the job raises it
        limit = getattr(model, "max_seq_len", 0) or self.max_seq_len
        if seq_len > limit:
            from titan_fold.common.config import ConfigError

            whose = f"{model.name} {model.flavor}'s" if model is not None else "the model's"
            raise ConfigError(
                f"training.seq_len = {seq_len}: longer than {whose} max_seq_len {limit} "
                "(set model.max_seq_len to train longer sequences)"
            )
        self.max_seq_len = seq_len
        mtp = getattr(job_config, "mtp", None)
        if mtp is not None:
            self.mtp_layers, self.mtp_loss_scaling_factor = mtp.num_layers, mtp.loss_scaling_factor
        moe_config = getattr(job_config, "moe", None)
        if moe_config is not None:
            moved = {f.name for f in dataclasses.fields(MovedMoEKeys)}  # read into their new keys
            overrides = {
                f.name: getattr(moe_config, f.name)
                for f in dataclasses.fields(moe_config)
                if f.name not in moved and getattr(moe_config, f.name) is not None
            }
            self.moe = dataclasses.replace(self.moe, **overrides)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Total parameters and training FLOPs per token (forward + backward).

        flops_per_token = 6 * N_active + 6 * n_layers * n_heads * head_dim * seq_len

        N_active: the parameters one token multiplies through: attention (with biases),
        norms, dense FFNs, shared experts and their gate, routers, the output head, and
        top_k / num_experts of the routed experts. The embedding lookup does no
        multiply, so an untied tok_embeddings table is left out; a tied one is counted
        once, as the output head. Each active parameter costs 2 FLOPs (multiply-add) in
        the forward and 4 in the backward (input and weight gradients): 6 in all.

        Attention scores: a query at position t (0-based) takes t + 1 dot products of
        head_dim with the keys (QK^T) and as many multiply-adds with the values (PV), per
        head: 2 * 2 * n_heads * head_dim * (t + 1) forward FLOPs. Averaged over a causal
        sequence of seq_len tokens, t + 1 ~ seq_len / 2 (exactly (seq_len + 1) / 2; we take
        seq_len / 2), so the forward costs 2 * n_heads * head_dim * seq_len per layer and
        forward + backward 3x that: 6 * n_layers * n_heads * head_dim * seq_len. A
        non-causal count would double it (the 12 of the usual non-causal formula).
        Softmax, RoPE, norms and the router's top-k are not counted.
        """
        total = sum(p.numel() for p in model.parameters())
        routed = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name)
        embedding = 0 if self.tie_embeddings else model.tok_embeddings.weight.numel()
        active = total - embedding - routed + routed * self.moe.top_k // self.moe.num_experts
        return total, int(6 * active + self.attention_flops([seq_len]) / seq_len)

    def attention_flops(self, lengths) -> float:
        """Training FLOPs of causal attention over sequences of the given lengths n_i (ints, or an
        int tensor), every layer's mixer_flops summed: with full attention in every layer,
        6 * n_layers * n_heads * head_dim * sum_i n_i^2 (get_nparams_and_flops' count, n_i / 2
        keys per query). Packed documents under document masking are the sequences: attention
        does not cross them."""
        n = torch.as_tensor(lengths, dtype=torch.float64)
        return sum(self.mixer_flops(i, n) for i in range(self.n_layers + self.mtp_layers))

    def mixer_flops(self, layer_id: int, lengths: torch.Tensor) -> float:
        """Training FLOPs of layer layer_id's token mixing beyond its parameters (the scores and
        their products with V) over sequences of lengths n [float64]: 6 * n_heads * head_dim * the
        (query, key) pairs counted as n^2 (twice the causal n^2 / 2); a sliding window w leaves
        2 n w - w^2 where n > w (w keys per query past the first w). A family with another mixer
        (linear attention) counts its own here."""
        per_pair = 6 * self.n_heads * self.attention_flops_dim()
        window = self.layer_window(layer_id)
        pairs = (
            lengths**2
            if window is None
            else torch.where(lengths <= window, lengths**2, 2 * lengths * window - window**2)
        )
        return per_pair * float(pairs.sum())

    def linear_attention_module(self) -> nn.Module:
        """The token mixer of a "linear_attention" layer (the families that have one say which)."""
        raise ValueError(f"{type(self).__name__}: layer_types names linear_attention, which this family has not")

    def rms_norm(self, dim: int) -> nn.Module:
        """The model's RMSNorm over `dim` (the blocks', the final one, the q/k norms)."""
        return nn.RMSNorm(dim, eps=self.norm_eps)
