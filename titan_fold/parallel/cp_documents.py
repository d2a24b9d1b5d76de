"""Context parallelism over packed documents (training.document_masking with cp > 1).

Under a per-document causal mask a query's work is the number of keys it sees: its position
in its document plus one. The two-chunk causal split (`attention.cp_shard`) balances a single
document only; a sample of a long document beside short ones loads the rank holding the long
one's end. Here each packed sample is cut into `blocks` equal blocks, every cp rank takes the
same number of them, and the blocks are dealt by their work:

    work of a block = sum over its tokens of (position in document + 1)
    blocks sorted by work, heaviest first, dealt in rounds of cp: to ranks 0 .. cp-1, then
    cp-1 .. 0, then 0 .. cp-1, ... (a snake); each rank's blocks kept in sample order

Two ranks' loads then differ by at most (heaviest block - lightest block): of two ranks, the
one dealt first in a round gains at most that round's spread of works over the other, and the
rounds' spreads add up to at most the spread of all the sorted works. One document and two
blocks per rank give back the two-chunk split.

The order comes from the batch's document ids on the host (`cp_order`, before the batch goes
to the device): no device value is read. `cp_shard_documents` then takes this rank's tokens
and labels, and hands the model every rank's document ids and token indices in the cp ranks'
order, from which it builds its positions and mask (models/documents.py: document_attention).
The loss is a sum over the same tokens as on one rank, so its value is the one-rank one.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_fold.models.documents import document_positions

# blocks at least this long where the sample allows: FlexAttention's tile, which a block
# boundary inside would leave partly masked on both sides
MIN_BLOCK_TOKENS = 128
MAX_BLOCKS_PER_RANK = 8


def blocks_per_rank(seq_len: int, cp: int) -> int:
    """The blocks each cp rank takes of a sample of seq_len tokens: the most (a power of two, 2
    to MAX_BLOCKS_PER_RANK) that divide it into blocks of MIN_BLOCK_TOKENS or more; 2 for shorter
    samples. seq_len must be a multiple of 2 * cp."""
    k = 2
    while 2 * k <= MAX_BLOCKS_PER_RANK and seq_len % (2 * k * cp) == 0 and seq_len // (2 * k * cp) >= MIN_BLOCK_TOKENS:
        k *= 2
    return k


def block_work(document_ids: torch.Tensor, blocks: int) -> torch.Tensor:
    """[b, s] document ids -> [b, blocks] int64: the (query, key) pairs each block's queries
    attend to under the per-document causal mask."""
    b, s = document_ids.shape
    return (document_positions(document_ids) + 1).view(b, blocks, s // blocks).sum(-1)


def deal_blocks(work: torch.Tensor, cp: int) -> list[list[int]]:
    """work [blocks] of one sample -> each cp rank's blocks (blocks / cp each, ascending): the
    snake deal of the module docstring."""
    heaviest_first = sorted(range(len(work)), key=lambda i: (-int(work[i]), i))
    ranks: list[list[int]] = [[] for _ in range(cp)]
    for round_start in range(0, len(heaviest_first), cp):
        deal = range(cp) if (round_start // cp) % 2 == 0 else range(cp - 1, -1, -1)
        for rank, block in zip(deal, heaviest_first[round_start : round_start + cp], strict=True):
            ranks[rank].append(block)
    return [sorted(blocks) for blocks in ranks]


def cp_order(document_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """[b, s] document ids (on the host) -> [b, s] int64: the sample's token indices as the cp
    ranks hold them, rank after rank (s / cp each), every sample dealt on its own."""
    b, s = document_ids.shape
    blocks = cp * blocks_per_rank(s, cp)
    size = s // blocks
    work = block_work(document_ids, blocks)
    rows = []
    for i in range(b):
        dealt = torch.tensor([block for rank in deal_blocks(work[i], cp) for block in rank])  # [blocks]
        rows.append((dealt[:, None] * size + torch.arange(size)).flatten())
    return torch.stack(rows)


def cp_shard_documents(
    tokens: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor, order: torch.Tensor, cp_mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's part of a packed batch under `order` ([b, s], cp_order's).

    tokens, document_ids [b, s], labels [b, s, ...] -> tokens_local [b, s/cp], labels_local
    [b, s/cp, ...] (the rank's blocks), and for the model every rank's document ids and token indices [b, s] in the cp
    ranks' order (Transformer.forward's document_ids and positions).
    """
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    n = tokens.shape[1] // cp
    mine = order[:, rank * n : (rank + 1) * n]
    return tokens.gather(1, mine), take(labels, mine), document_ids.gather(1, order), order


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [b, s, ...] at the positions index [b, n] of each row -> [b, n, ...]."""
    index = index.view(*index.shape, *(1,) * (x.dim() - 2)).expand(*index.shape, *x.shape[2:])
    return x.gather(1, index)
