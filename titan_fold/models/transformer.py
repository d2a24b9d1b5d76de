"""Decoder-only MoE transformer: Qwen2-MoE, Qwen3-MoE and Mixtral are flavors of this one model.

    tokens [b, s] -> tok_embeddings -> n_layers x TransformerBlock -> norm -> output -> logits [b, s, vocab]
    block: h = x + attention(attention_norm(x)); out = h + (moe | feed_forward)(ffn_norm(h))

A block's token mixer (`attention`) is the one its layer type names (args.layer_types, MIXERS):
full attention, sliding-window attention, or a family's own (linear attention). The attention's
variants (sinks, window, output gate, partial rotary) are models/attention.py's.

Module names follow torchtitan's (tok_embeddings, layers["i"], attention.wq, ...), so its
parallel plans, activation checkpointing (one TransformerBlock = layers["i"]) and pipeline
splitting (stages set tok_embeddings / norm / output to None and drop layers) apply as is.
Layers read their local head count from tensor shapes, so tensor parallelism that shards
wq/wk/wv by heads needs no change here.
"""

import math
from collections.abc import Callable

import torch
from torch import nn
from torchtitan.protocols.model import ModelProtocol

from titan_fold.common.tensors import local
from titan_fold.models.args import TransformerArgs
from titan_fold.models.attention import attend
from titan_fold.models.documents import DocumentMask, document_attention
from titan_fold.models.layers import apply_rope_qk, trunc_normal_
from titan_fold.models.mtp import MultiTokenPrediction
from titan_fold.moe import FeedForward, MoE
from titan_fold.moe.router import AddAuxLoss


class CausalSelfAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim) + causal mask) v on [b, heads, s, head_dim] tensors;
    with a document mask (models/documents.py), causal within each packed document; with a
    window, over the last `window` keys; with sinks, each head's sink in the softmax
    (models/attention.py: the interface and the kernels).

    Its own module so context parallelism can swap in a version that gathers K/V over
    the cp ranks and masks by global position; q, k, v arrive after RoPE.
    """

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: DocumentMask | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return attend(q, k, v, mask, sinks, self.window)


class Sinks(nn.Module):
    """GPT-OSS's attention sinks: one logit per head [heads], sharded with the heads under tp."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        return local(self.weight)  # [heads this rank holds]


class Attention(nn.Module):
    """Grouped-query attention with RoPE, and the variants args turns on: biases, Qwen3's q/k
    norms, sinks, a sliding window (window), an output gate and partial rotary."""

    def __init__(self, args: TransformerArgs, window: int | None = None):
        super().__init__()
        self.head_dim, self.rotary_dim = args.head_dim, args.rotary_dim
        self.output_gate = args.attention_output_gate
        # with the output gate, each head's wq rows are its query, then its gate
        q_width = args.head_dim * (2 if self.output_gate else 1)
        self.wq = nn.Linear(args.dim, args.n_heads * q_width, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.out_bias)
        # Qwen3: each query / key head is RMS-normalized over head_dim (one weight shared by all heads)
        self.q_norm = args.rms_norm(args.head_dim) if args.qk_norm else None
        self.k_norm = args.rms_norm(args.head_dim) if args.qk_norm else None
        self.sinks = Sinks(args.n_heads) if args.attention_sinks else None
        self.inner_attention = CausalSelfAttention(window)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads this rank holds (all of them without tensor parallelism)
        q = self.wq(x).view(b, s, -1, self.head_dim * (2 if self.output_gate else 1))  # [b, s, heads, q_width]
        gate = None
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)  # [b, s, heads, head_dim] each
        k = self.wk(x).view(b, s, -1, self.head_dim)  # [b, s, kv_heads, head_dim]
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.rotary_dim == self.head_dim:
            q, k = apply_rope_qk(q, k, cos, sin, self.q_norm, self.k_norm)
        else:  # partial rotary: norms over the whole head, RoPE on its first rotary_dim dims
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            r = self.rotary_dim
            q_rot, k_rot = apply_rope_qk(q[..., :r], k[..., :r], cos, sin)
            q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        sinks = self.sinks() if self.sinks is not None else None
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, sinks).transpose(
            1, 2
        )  # [b, s, heads, head_dim]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(b, s, -1))

    def init_weights(self, init_std: float, out_std: float):
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, init_std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        trunc_normal_(self.wo.weight, out_std)
        if self.wo.bias is not None:
            nn.init.zeros_(self.wo.bias)
        if self.q_norm is not None:
            self.q_norm.reset_parameters()
            assert self.k_norm is not None  # built with q_norm
            self.k_norm.reset_parameters()
        if self.sinks is not None:
            nn.init.zeros_(self.sinks.weight)  # a sink of logit 0: one extra exp(0) in each softmax


# The token mixer of each layer type (TransformerArgs.layer_types): (args, layer id) -> the
# block's `attention` module, called as attention(x, cos, sin, mask=...) -> [b, s, dim]. A family
# with another mixer (linear attention) adds its builder here.
MIXERS: dict[str, Callable[[TransformerArgs, int], nn.Module]] = {
    "full_attention": lambda args, layer_id: args.attention_module() or Attention(args),
    "sliding_attention": lambda args, layer_id: Attention(args, window=args.layer_window(layer_id)),
    # its mask: each token's position in its packed document (None: one document per sample)
    "linear_attention": lambda args, layer_id: args.linear_attention_module(),
}


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TransformerArgs):
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = args.layer_type(layer_id)
        self.window = args.layer_window(layer_id)  # its mask's window (Transformer.forward)
        self.attention_norm = args.rms_norm(args.dim)
        if self.layer_type not in MIXERS:
            raise ValueError(f"layer {layer_id}: layer type {self.layer_type!r} has no mixer (transformer.MIXERS)")
        self.attention = MIXERS[self.layer_type](args, layer_id)
        self.ffn_norm = args.rms_norm(args.dim)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe)
            # this layer's place among the model's MoE layers (routed_experts' layer dim): counted
            # over the whole model, so a pipeline stage's layers read their own columns. None in
            # an MTP layer's block (layer_id >= n_layers): no column, its router chooses
            main = layer_id < args.n_layers
            self.moe.moe_index = sum(args.is_moe_layer(i) for i in range(layer_id)) if main else None
            self.moe.n_moe_layers = args.n_moe_layers()
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: DocumentMask | None = None,
        routed_experts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """routed_experts [b, s', n_moe_layers, k]: the experts to replay (Transformer.forward)."""
        # mask as a keyword: the tp plan lays out the positional inputs only
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        if not self.moe_enabled:
            return h + self.feed_forward(self.ffn_norm(h))
        index = self.moe.moe_index
        replayed = None if routed_experts is None or index is None else routed_experts[:, :, index]  # [b, s', k]
        return h + self.moe(self.ffn_norm(h), routed_experts=replayed)

    def init_weights(self, init_std: float):
        # Depth-scaled output projections: every block adds to the residual stream, so the
        # writes shrink with depth to keep its variance from growing with n_layers.
        out_std = init_std / math.sqrt(2 * (self.layer_id + 1))
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(init_std, out_std)
        if self.moe_enabled:
            self.moe.init_weights(out_std)
        else:
            self.feed_forward.init_weights(init_std, out_std)


class Transformer(ModelProtocol):
    rope_cos: torch.Tensor  # [max_seq_len, rotated dims], a buffer
    rope_sin: torch.Tensor

    def __init__(self, args: TransformerArgs):
        super().__init__(args)
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = args.rms_norm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.mtp = MultiTokenPrediction(args, TransformerBlock) if args.mtp_layers > 0 else None
        # forward's first input: token ids; False on a later pipeline stage, which gets hidden
        # states (its tok_embeddings, if any, is the MTP layers' copy of the first stage's)
        self.embeds_tokens = True
        # (this rank's part, parts) of a packed sample's queries: (cp rank, cp) after apply_cp
        self.query_part = (0, 1)
        # non-persistent: recomputed by init_weights, never saved in checkpoints
        cos, sin = args.rope_tables()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def transformer_blocks(self) -> list[TransformerBlock]:
        """Every block: the layers this model (or pipeline stage) holds, then the MTP layers'."""
        mtp = [layer.block for layer in self.mtp.layers.values()] if self.mtp is not None else []
        return [*self.layers.values(), *mtp]

    def init_weights(self, buffer_device: torch.device | None = None):
        """Fill every parameter and buffer, e.g. after building on meta and `to_empty()`."""
        args, init_std = self.args, 0.02
        buffer_device = buffer_device or self.rope_cos.device
        with torch.device(buffer_device):
            self.rope_cos, self.rope_sin = args.rope_tables()
        if args.tie_embeddings:
            # to_empty() gives each module its own new tensor: tie again
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings is not None:
            # untied: unit-scale rows, as the first RMSNorm expects; tied: the output head's scale
            nn.init.normal_(self.tok_embeddings.weight, std=args.dim**-0.5 if args.tie_embeddings else 1.0)
        for layer in self.layers.values():
            layer.init_weights(init_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not args.tie_embeddings:
            trunc_normal_(self.output.weight, args.dim**-0.5)
        if self.mtp is not None:
            self.mtp.init_weights(init_std)

    def rope(self, seq_len: int, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the tokens' positions: [seq_len, head_dim], or [b, s, head_dim] for positions [b, s]."""
        if positions is None:
            if seq_len > self.args.max_seq_len:
                raise ValueError(f"sequence length {seq_len} > max_seq_len {self.args.max_seq_len}")
            return self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        return self.rope_cos[positions], self.rope_sin[positions]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        future_tokens: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [b, s] int64 (or hidden states [b, s, dim] on a later pipeline stage).

        positions: global positions of these tokens, [s] or [b, s] int64, for context
        parallelism where a rank holds non-contiguous chunks; None = 0 .. s-1. With
        document_ids under cp: [b, cp * s], each token's index in its packed sample.
        future_tokens: [b, s, mtp_layers + 1] int64, the tokens 1 .. mtp_layers + 1 positions
        after each input token (IGNORE_INDEX past the end), for Multi-Token Prediction; its
        loss enters backward through the logits (AddAuxLoss), its value goes to metrics.
        document_ids: [b, s] int64, the packed document of each token (training.document_masking):
        attention stays within a document and positions restart at each one (models/documents.py).
        Under cp [b, cp * s]: every cp rank's tokens, rank after rank (parallel/cp_documents.py).
        routed_experts: [b, s', n_moe_layers, k] int64, the experts each MoE layer takes instead of
        its router's choice (routing replay, moe/replay.py), n_moe_layers counting the whole model's
        MoE layers in order; s' the tokens an MoE layer holds (s, or s / tp under sequence parallelism:
        the trainer splits them as the layers' inputs are, moe/replay.py: shard_routed_experts).
        Returns logits [b, s, vocab] (hidden states on a stage without the output head).
        """
        h = self.tok_embeddings(tokens) if self.embeds_tokens else tokens  # [b, s, dim]
        # one mask per window among the layers (full attention: None); the layers' own
        # causal (and window) masks where there are no documents
        masks: dict[int | None, DocumentMask | None] = {layer.window: None for layer in self.layers.values()} or {
            None: None
        }
        if document_ids is not None:
            if future_tokens is not None:
                raise ValueError("document_ids: no future tokens (MTP) with packed documents")
            order = positions
            for window in masks:
                positions, masks[window] = document_attention(document_ids, order, *self.query_part, window=window)
        cos, sin = self.rope(h.shape[1], positions)
        # a linear-attention layer's document mask: each token's position in its document
        in_document = positions if document_ids is not None else None
        for layer in self.layers.values():
            mask = in_document if layer.layer_type == "linear_attention" else masks[layer.window]
            h = layer(h, cos, sin, mask) if routed_experts is None else layer(h, cos, sin, mask, routed_experts)
        out = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return out
        logits = self.output(out)
        if self.mtp is not None and future_tokens is not None:
            logits = AddAuxLoss.apply(logits, self.mtp(h, future_tokens, cos, sin, self.tok_embeddings, self.output))
        return logits
