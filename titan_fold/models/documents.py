"""Per-document attention inside a packed sample (training.document_masking).

A packed sample carries `document_ids` [b, s] beside its tokens: the document each token
belongs to, constant within a document and changing at each boundary. From it the model takes
the positions (RoPE restarts at 0 in every document) and the attention mask (a query sees the
keys of its own document up to itself). On CUDA the mask is a FlexAttention BlockMask, whose
kernels skip the blocks that cross documents; elsewhere (the CPU) an explicit boolean mask
[b, 1, s, s] for scaled_dot_product_attention's math path.
"""

import functools

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # no FlexAttention in this build: the explicit mask everywhere
    BlockMask = create_block_mask = flex_attention = None

DocumentMask = torch.Tensor  # bool [b, 1, s, s] (True: attend), or a FlexAttention BlockMask

_BLOCK = 128  # FlexAttention's default block: a kv block is skipped, computed whole or masked


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] int64: each token's position within its document (0 at every document's first token)."""
    b, s = document_ids.shape
    index = torch.arange(s, device=document_ids.device).expand(b, s)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # the index of the latest document start at or before each token
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process, for calls outside a compiled region."""
    return torch.compile(flex_attention, dynamic=False)


def _uses_flex(document_ids: torch.Tensor) -> bool:
    return document_ids.is_cuda and flex_attention is not None


def _mask_mod(document_ids: torch.Tensor):
    """FlexAttention's mask_mod: a query sees the keys of its own document up to itself."""

    def mask_mod(batch, head, q_idx, kv_idx):
        return (document_ids[batch, q_idx] == document_ids[batch, kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def _block_lists(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flags [b, n, n] bool -> (count [b, 1, n], indices [b, 1, n, n]) int32: the kv blocks set in
    each q block's row, listed first (FlexAttention reads only the first `count`)."""
    order = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True)
    return flags.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]


def flex_block_mask(document_ids: torch.Tensor, block: int = _BLOCK) -> "BlockMask":
    """The FlexAttention BlockMask of document_ids [b, s] (non-decreasing along s, as packing
    numbers documents; s a multiple of block), built from each block's first and last document:
    O((s / block)^2) work, where create_block_mask evaluates the mask at every (q, kv) pair."""
    b, s = document_ids.shape
    n = s // block
    ids = document_ids.view(b, n, block)
    first, last = ids[..., 0], ids[..., -1]  # [b, n]
    q = torch.arange(n, device=document_ids.device)
    before = (q[None, :] < q[:, None])[None]  # [1, n_q, n_kv]: the kv block precedes the q block
    # ids do not decrease, so a kv block before the q block shares a document with it iff its last
    # document is the q block's first, and every pair attends iff its first is the q block's last
    shares = before & (last[:, None, :] == first[:, :, None])
    full = shares & (first[:, None, :] == last[:, :, None])
    partial = (shares & ~full) | torch.eye(n, dtype=torch.bool, device=document_ids.device)[None]
    kv_num, kv_index = _block_lists(partial)
    full_num, full_index = _block_lists(full)

    return BlockMask.from_kv_blocks(
        kv_num, kv_index, full_num, full_index, BLOCK_SIZE=block, mask_mod=_mask_mod(document_ids)
    )


def document_mask(document_ids: torch.Tensor) -> DocumentMask:
    """The attention mask of the packed samples document_ids [b, s]: causal within each document."""
    b, s = document_ids.shape
    if _uses_flex(document_ids):
        if s % _BLOCK == 0:
            return flex_block_mask(document_ids)
        return create_block_mask(_mask_mod(document_ids), b, None, s, s, device=document_ids.device)
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [b, s, s]
    return (same & causal).unsqueeze(1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
    """Attention of q [b, heads, s, d] over k [b, kv_heads, s, d], v [b, kv_heads, s, d_v] under mask."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        # inside a compiled block dynamo lowers flex_attention itself; eager calls take the
        # compiled kernel (FlexAttention's eager path materializes the scores)
        flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
        return flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if q.shape[1] != k.shape[1]:
        # GQA: SDPA with an explicit mask does not take enable_gqa on every backend
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
