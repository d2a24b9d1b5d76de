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

    def on_host(self, dispatcher, counts: torch.Tensor, gathered: torch.Tensor, rows: int):
        sent = _even(rows, counts.numel())
        return sent, sent * dispatcher.etp


def _even(rows: int, n: int) -> list[int]:
    return [rows // n + (e < rows % n) for e in range(n)]


def use_fake_counts(model_parts: list[nn.Module]) -> None:
    """Every MoE layer of the parts learns the other ranks' routing and counts as FakeCounts says."""
    for moe in moe_layers(model_parts):
        moe.dispatcher.counts = FakeCounts()
