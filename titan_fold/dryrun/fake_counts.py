"""The routing and row counts a dry run's MoE layers work with: its fake process group issues
every collective and returns no values, so each rank takes the other ranks to route as it does."""

import torch
import torch.nn as nn

from titan_fold.moe import moe_layers
from titan_fold.moe.counts import ExchangedCounts


class FakeCounts(ExchangedCounts):
    """ExchangedCounts' collectives, issued as a real run issues them (the dry run records
    them); their results replaced by this rank's own routing repeated over the sequence group
    and rows spread evenly over the experts, every source sending this rank what this rank
    sends it (split sizes agree both ways)."""

    def sequences(self, dispatcher, packed: torch.Tensor) -> torch.Tensor:
        super().sequences(dispatcher, packed)
        return packed.repeat(dispatcher.seq_mesh.size(), 1)

    def sources(self, dispatcher, counts: torch.Tensor, rows: int) -> torch.Tensor:
        super().sources(dispatcher, counts, rows)
        sent = _even(rows, counts.numel())
        return torch.tensor(sent * dispatcher.etp, dtype=torch.int64, device=counts.device)

    def everywhere(self, dispatcher, counts: torch.Tensor) -> torch.Tensor:
        super().everywhere(dispatcher, counts)
        return counts.repeat(dispatcher.etp * dispatcher.ep, 1)

    # the gradient check's view of copies of hot experts (dryrun/copies.py): called with the
    # weight's name, the alias of the weights the copies are read from, the copies and the rows
    # of the nominees this rank holds; None: not watched
    on_copies = None

    def copies(self, dispatcher, w: torch.Tensor, nominees: torch.Tensor, name: str) -> torch.Tensor:
        held = w.view_as(w)  # its own autograd node: its gradient is the copies' share of w's
        out = super().copies(dispatcher, held, nominees, name)
        if self.on_copies is not None:
            first = dispatcher.ep_mesh.get_local_rank() * w.shape[0]  # this rank's first expert id
            rows = nominees[(nominees >= first) & (nominees < first + w.shape[0])] - first
            self.on_copies(name, held, out, rows)
        return out

    def on_host(self, dispatcher, counts: torch.Tensor, gathered: torch.Tensor, rows: int):
        sent = _even(rows, counts.numel())
        return sent, sent * dispatcher.etp


def _even(rows: int, n: int) -> list[int]:
    return [rows // n + (e < rows % n) for e in range(n)]


def use_fake_counts(model_parts: list[nn.Module]) -> None:
    """Every MoE layer of the parts learns the other ranks' routing and counts as FakeCounts says."""
    for moe in moe_layers(model_parts):
        moe.dispatcher.counts = FakeCounts()
