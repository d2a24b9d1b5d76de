"""Attention variants behind one interface: sinks, sliding window, output gate, partial rotary.

Every inner attention (transformer.CausalSelfAttention, parallel/attention.py's
ContextParallelAttention) is one call of the same contract:

    inner_attention(q, k, v, mask=None, sinks=None) -> out [b, heads, s_q, d_v]
    q [b, heads, s_q, d], k, v [b, kv_heads, s_k, d]          after RoPE
    mask   None: causal (and the module's own `window`) from positions; else a DocumentMask
           (models/documents.py) that already holds the window
    sinks  [heads] or None: one learned logit per head that joins every query's softmax and
           attends to nothing (GPT-OSS), so a head may put weight nowhere

and `attend` picks the kernel once per call:

    BlockMask (CUDA, packed documents)   FlexAttention; sinks by its log-sum-exp:
                                         out * sigmoid(lse - sink) (the sink's share removed)
    bool mask or causal, no sinks        scaled_dot_product_attention
    sinks, CPU                           the math: softmax over [scores, sink], sink dropped
    sinks or window, CUDA, no documents  FlexAttention with a causal (+ window) BlockMask

The sliding window: a query at position t sees keys t - window + 1 .. t (transformers'
`sliding_window`, GPT-OSS's 128). The output gate (Qwen3.5's gated attention: wq gives each
head its query and a gate, out * sigmoid(gate) before wo) and partial rotary (RoPE on the first
`rotary_dim` of head_dim) live in transformer.Attention, which builds the q, k, v this takes.
The FlexAttention paths are not exercised by the CPU tests; tests/test_attention_gpu.py checks
them on a GPU against the math path in float64.
"""

import torch
import torch.nn.functional as F

from titan_fold.models.documents import (
    BlockMask,
    DocumentMask,
    _compiled_flex,
    create_block_mask,
    flex_attention,
    masked_attention,
)


def window_allows(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [..., s_q, s_k]: causal and, with a window, within `window` positions (q_pos [..., s_q],
    k_pos [..., s_k])."""
    delta = q_pos[..., :, None] - k_pos[..., None, :]
    allowed = delta >= 0
    return allowed if window is None else allowed & (delta < window)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """softmax([q k^T / sqrt(d) masked, sink]) without the sink's column, times v: the reference
    (transformers' eager GPT-OSS attention). mask bool [b | 1, 1 | heads, s_q, s_k] (True: attend)."""
    b, h, s_q, d = q.shape
    if h != k.shape[1]:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * d**-0.5  # [b, heads, s_q, s_k]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, s_q, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _flex(q, k, v, block_mask, sinks):
    flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    if sinks is None:
        return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    out, lse = flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], return_lse=True)
    # the sink's share of each query's softmax: 1 - exp(lse) / (exp(lse) + exp(sink))
    keep = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))  # [b, heads, s_q]
    return out * keep.unsqueeze(-1).to(out.dtype)


# built per call, not cached: activation checkpointing replays a block's ops in backward and
# expects the same ones (a cache hit skips create_block_mask's)
def _causal_block_mask(s_q: int, s_k: int, window: int | None, device: torch.device):
    def mask_mod(batch, head, q_idx, kv_idx):
        q = q_idx + (s_k - s_q)
        allowed = kv_idx <= q
        return allowed if window is None else allowed & (q - kv_idx < window)

    return create_block_mask(mask_mod, None, None, s_q, s_k, device=device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The inner attention's kernel choice (module docstring). mask None: causal with the last
    query at the last key (s_q <= s_k: a cp rank's chunk of queries over the keys up to its end),
    and `window` applied here; a mask holds its own window."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        return _flex(q, k, v, mask, sinks)
    if mask is None:
        s_q, s_k = q.shape[2], k.shape[2]
        # SDPA's is_causal aligns the first query with the first key: only for s_q == s_k
        if sinks is None and window is None and s_q == s_k:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        if (sinks is not None or window is not None) and q.is_cuda and flex_attention is not None:
            return _flex(q, k, v, _causal_block_mask(s_q, s_k, window, q.device), sinks)
        positions = torch.arange(s_k, device=q.device)
        mask = window_allows(positions[s_k - s_q :], positions, window)[None, None]  # [1, 1, s_q, s_k]
    if sinks is None:
        return masked_attention(q, k, v, mask)
    return sink_attention(q, k, v, mask, sinks)
