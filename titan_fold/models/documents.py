"""Per-document attention inside a packed sample (training.document_masking).

A packed sample carries `document_ids` [b, s] beside its tokens: the document each token
belongs to, constant within a document and changing at each boundary. From it the model takes
the positions (RoPE restarts at 0 in every document) and the attention mask (a query sees the
keys of its own document up to itself). On CUDA the mask is a FlexAttention BlockMask, whose
kernels skip the blocks that cross documents; elsewhere (the CPU) an explicit boolean mask
[b, 1, s, s] for scaled_dot_product_attention's math path.
"""

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # no FlexAttention in this build: the explicit mask everywhere
    BlockMask = create_block_mask = flex_attention = None

DocumentMask = torch.Tensor  # bool [b, 1, s, s] (True: attend), or a FlexAttention BlockMask

_compiled_flex = None


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] int64: each token's position within its document (0 at every document's first token)."""
    b, s = document_ids.shape
    index = torch.arange(s, device=document_ids.device).expand(b, s)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # the index of the latest document start at or before each token
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def _uses_flex(document_ids: torch.Tensor) -> bool:
    return document_ids.is_cuda and flex_attention is not None


def document_mask(document_ids: torch.Tensor) -> DocumentMask:
    """The attention mask of the packed samples document_ids [b, s]: causal within each document."""
    b, s = document_ids.shape
    if _uses_flex(document_ids):

        def mask_mod(batch, head, q_idx, kv_idx):
            return (document_ids[batch, q_idx] == document_ids[batch, kv_idx]) & (kv_idx <= q_idx)

        return create_block_mask(mask_mod, b, None, s, s, device=document_ids.device)
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [b, s, s]
    return (same & causal).unsqueeze(1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
    """Attention of q [b, heads, s, d] over k [b, kv_heads, s, d], v [b, kv_heads, s, d_v] under mask."""
    global _compiled_flex
    if BlockMask is not None and isinstance(mask, BlockMask):
        if _compiled_flex is None:
            # compiled once per process: FlexAttention's eager path materializes the scores
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if q.shape[1] != k.shape[1]:
        # GQA: SDPA with an explicit mask does not take enable_gqa on every backend
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
