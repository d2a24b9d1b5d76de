"""Per-document attention inside a packed sample (training.document_masking).

A packed sample carries `document_ids` [b, s] beside its tokens: the document each token
belongs to, constant within a document and changing at each boundary. From it the model takes
the positions (RoPE restarts at 0 in every document) and the attention mask (a query sees the
keys of its own document up to itself). On CUDA the mask is a FlexAttention BlockMask, whose
kernels skip the blocks that cross documents; elsewhere (the CPU) an explicit boolean mask
[b, 1, s, s] for scaled_dot_product_attention's math path.

Under context parallelism (parallel/cp_documents.py) a rank holds blocks of a packed sample in
an order of their own: `document_attention` then takes the whole sample's document ids and
token indices in the cp ranks' order and gives this rank's queries their positions and their
mask over every rank's keys [b, 1, s/cp, s], keys in the order the cp ranks gather them.
"""

import functools
from typing import TypeAlias

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # no FlexAttention in this build: the explicit mask everywhere
    BlockMask = create_block_mask = flex_attention = None

DocumentMask: TypeAlias = torch.Tensor  # bool [b, 1, s, s] (True: attend), or a FlexAttention BlockMask

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


def document_lengths(document_ids: torch.Tensor) -> torch.Tensor:
    """[documents] int64: the length of every document of document_ids [b, s], sample by sample
    (a document cut by a sample's end counts in each sample it is in)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = starts.flatten().nonzero().flatten()  # every sample's first token starts a document
    return torch.diff(first, append=first.new_tensor([document_ids.numel()]))


def one_document(document_ids: torch.Tensor) -> bool:
    """True where every sample of document_ids [b, s] holds one document (or a piece of one):
    its mask is then the causal mask and its positions 0 .. s-1, so the stream's causal kernel
    (cuDNN or flash on CUDA) serves it, faster than FlexAttention on the same mask, without
    context parallelism (trainer/step.py). Read on the host, before the batch moves to the device."""
    return bool((document_ids == document_ids[:, :1]).all())


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process, for calls outside a compiled region."""
    return torch.compile(flex_attention, dynamic=False)


def _uses_flex(document_ids: torch.Tensor) -> bool:
    return document_ids.is_cuda and flex_attention is not None


def _mask_mod(document_ids: torch.Tensor, order: torch.Tensor | None = None, q0: int = 0, window: int | None = None):
    """FlexAttention's mask_mod: a query sees the keys of its own document up to itself (and,
    with a window, fewer than `window` tokens back). order: each token's index in its sample
    (None: the tokens in the sample's order); q0: the first query's place among the tokens."""
    if order is None:

        def mask_mod(batch, head, q_idx, kv_idx):
            q = q0 + q_idx
            allowed = (document_ids[batch, q] == document_ids[batch, kv_idx]) & (kv_idx <= q)
            return allowed if window is None else allowed & (q - kv_idx < window)

    else:

        def mask_mod(batch, head, q_idx, kv_idx):
            q = q0 + q_idx
            same = document_ids[batch, q] == document_ids[batch, kv_idx]
            allowed = same & (order[batch, kv_idx] <= order[batch, q])
            return allowed if window is None else allowed & (order[batch, q] - order[batch, kv_idx] < window)

    return mask_mod


def _block_lists(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flags [b, n_q, n_kv] bool -> (count [b, 1, n_q], indices [b, 1, n_q, n_kv]) int32: the kv
    blocks set in each q block's row, listed first (FlexAttention reads only the first `count`)."""
    order = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True)
    return flags.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]


def flex_block_mask(
    document_ids: torch.Tensor, block: int = _BLOCK, order: torch.Tensor | None = None, queries: slice | None = None
) -> "BlockMask":
    """The FlexAttention BlockMask of document_ids [b, s] (s and the queries' count multiples of
    block), built from each block's smallest and largest document and sample index: O((s /
    block)^2) work, where create_block_mask evaluates the mask at every (q, kv) pair.

    order [b, s]: each token's index in its sample (None: the sample's order); queries: the
    tokens whose rows the mask has (every token by default). A kv block is skipped where no
    pair can attend (no document in common, or every key after every query), full where one
    document holds both blocks and every key comes before every query, else masked by
    mask_mod. Packing numbers documents in non-decreasing order, so in the sample's order these
    are exactly the blocks create_block_mask finds (tests/test_documents.py).
    """
    b, s = document_ids.shape
    queries = queries or slice(0, s)
    mask_mod = _mask_mod(document_ids, order, queries.start)
    if order is None:
        order = torch.arange(s, device=document_ids.device).expand(b, s)

    def bounds(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [b, n, block] -> [b, n] twice
        return x.amin(-1), x.amax(-1)

    kv_ids, kv_index = (x.view(b, s // block, block) for x in (document_ids, order))
    q_ids, q_index = (x[:, queries].view(b, -1, block) for x in (document_ids, order))
    (kv_first, kv_last), (q_first, q_last) = bounds(kv_ids), bounds(q_ids)
    (kv_lo, kv_hi), (q_lo, q_hi) = bounds(kv_index), bounds(q_index)
    # [b, n_q, n_kv]: a document in common, and a key not after a query
    shares = (kv_first[:, None, :] <= q_last[:, :, None]) & (q_first[:, :, None] <= kv_last[:, None, :])
    some = shares & (kv_lo[:, None, :] <= q_hi[:, :, None])
    one = (kv_first == kv_last)[:, None, :] & (q_first == q_last)[:, :, None]
    full = some & one & (kv_first[:, None, :] == q_first[:, :, None]) & (kv_hi[:, None, :] <= q_lo[:, :, None])
    kv_num, kv_indices = _block_lists(some & ~full)
    full_num, full_indices = _block_lists(full)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=block, mask_mod=mask_mod)


def document_mask(
    document_ids: torch.Tensor,
    order: torch.Tensor | None = None,
    queries: slice | None = None,
    window: int | None = None,
) -> DocumentMask:
    """The attention mask of the packed samples document_ids [b, s]: causal within each document,
    and with a window (sliding-window layers) fewer than `window` tokens back.

    order [b, s]: each token's index in its packed sample, where the tokens come in another
    order than the sample's (cp); None: in the sample's. queries: the tokens whose rows the mask
    has (this cp rank's), every token by default; the keys are always all s tokens.
    """
    b, s = document_ids.shape
    queries = queries or slice(0, s)
    q0, q_len = queries.start, queries.stop - queries.start
    if _uses_flex(document_ids):
        if window is None and s % _BLOCK == 0 and q_len % _BLOCK == 0:
            return flex_block_mask(document_ids, order=order, queries=queries)
        mask_mod = _mask_mod(document_ids, order, q0, window)
        return create_block_mask(mask_mod, b, None, q_len, s, device=document_ids.device)
    if order is None:
        order = torch.arange(s, device=document_ids.device).expand(b, s)
    same = document_ids[:, queries, None] == document_ids[:, None, :]  # [b, q_len, s]
    delta = order[:, queries, None] - order[:, None, :]  # [b, q_len, s] query index - key index
    allowed = same & (delta >= 0)
    if window is not None:
        allowed = allowed & (delta < window)
    return allowed.unsqueeze(1)


def document_attention(
    document_ids: torch.Tensor,
    order: torch.Tensor | None = None,
    part: int = 0,
    parts: int = 1,
    window: int | None = None,
) -> tuple[torch.Tensor, DocumentMask]:
    """(positions [b, s/parts], mask) of the queries of part `part` of `parts` equal parts:
    each token's position within its document (RoPE) and the mask over all s keys (with
    `window`: a sliding-window layer's).

    document_ids [b, s] and order [b, s] (each token's index in its packed sample, None: in the
    sample's order) list every part's tokens, part after part, as the cp ranks gather them.
    """
    if order is None:
        return document_positions(document_ids), document_mask(document_ids, window=window)
    b, s = document_ids.shape
    in_sample = torch.empty_like(document_ids).scatter_(1, order, document_ids)  # [b, s], the sample's order
    positions = document_positions(in_sample).gather(1, order)  # [b, s], the parts' order
    n = s // parts
    queries = slice(part * n, (part + 1) * n)
    return positions[:, queries], document_mask(document_ids, order, queries, window)


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
