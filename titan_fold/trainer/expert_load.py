"""Per-expert load (`metrics.expert_load`): each MoE layer's routed assignments per expert over
the logged interval, summed over every rank's tokens.

The layers count on the device (MoE.load, no host sync in forward); at a logged step every rank
adds its layers' rows into one [MoE layers of the model, experts] table, an all-reduce sums it
over the world (ranks of other pipeline stages add zeros), and rank 0 writes:

- in metrics.jsonl, `expert_load`: per layer, the busiest expert's load over the mean, the
  busiest ep rank's (its experts' rows together) over the mean, and the three hottest experts;
- in expert_load.jsonl beside it, the full counts: {"step", "layers", "counts" [layers][experts]};
- with metrics.enable_tensorboard, a histogram of each layer's counts (`expert_load/<layer>`).

`python -m titan_fold.plot DUMP_FOLDER --expert-load` draws them as layer x expert heat maps.
"""

import json
import os

import torch
import torch.distributed as dist

from titan_fold.common.tensors import model_fqn
from titan_fold.moe.layer import MoE
from titan_fold.trainer.metrics_file import EXPERT_LOAD_FILE

HOTTEST = 3


def _moe_modules(model_parts: list[torch.nn.Module]) -> dict[str, MoE]:
    """{layer name (the module path before ".moe", without the wrappers of compile and activation
    checkpointing): its MoE} of this rank's model parts."""
    found = {}
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                found[model_fqn(name).removesuffix(".moe")] = module
    return found


def _layer_key(name: str) -> tuple[int, int, str]:
    # "layers.12" after "layers.3"; other names (MTP's) after every numbered layer
    head, _, tail = name.rpartition(".")
    return (0, int(tail), "") if head == "layers" and tail.isdigit() else (1, 0, name)


class ExpertLoad:
    """Collects and writes the per-expert load at logged steps (every rank calls `collect`)."""

    def __init__(
        self, model_parts: list[torch.nn.Module], dump_folder: str, ep: int, tensorboard_folder: str | None
    ) -> None:
        self.model_parts, self.ep = model_parts, ep
        self.names: list[str] | None = None  # every MoE layer of the model, in layer order
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.file = os.path.join(dump_folder, EXPERT_LOAD_FILE) if rank == 0 else None
        self.writer = None
        if tensorboard_folder and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(tensorboard_folder, "expert_load"))

    @torch.no_grad()
    def collect(self, step: int) -> dict | None:
        """The load since the last call, then reset; -> metrics.jsonl's summary on rank 0, else None."""
        mine = _moe_modules(self.model_parts)
        if self.names is None:  # the model's MoE layers, from every pipeline stage: once
            names = [list(mine)]
            if dist.is_initialized() and dist.get_world_size() > 1:
                names = [[] for _ in range(dist.get_world_size())]  # all_gather_object fills it
                dist.all_gather_object(names, list(mine))
            self.names = sorted({n for ns in names for n in ns}, key=_layer_key)
        if not self.names:
            return None
        E = next(iter(mine.values())).load.numel() if mine else 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            sizes = torch.tensor([E], device=_device(mine))
            dist.all_reduce(sizes, op=dist.ReduceOp.MAX)  # a rank without MoE layers learns E
            E = int(sizes)
        table = torch.zeros(len(self.names), E, dtype=torch.float64, device=_device(mine))  # [layers, E]
        for name, module in mine.items():
            table[self.names.index(name)] = module.load
            module.load.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)
        if self.file is None:
            return None
        counts = table.cpu()
        self._write(self.file, self.names, step, counts)
        return summary(self.names, counts, self.ep)

    def _write(self, file: str, names: list[str], step: int, counts: torch.Tensor) -> None:
        rows = [[round(c) for c in row] for row in counts.tolist()]
        with open(file, "a") as f:
            f.write(json.dumps({"step": step, "layers": names, "counts": rows}) + "\n")
        if self.writer is not None:
            for name, row in zip(names, counts, strict=True):
                self.writer.add_histogram(f"expert_load/{name}", row, step)
            self.writer.flush()


def _device(mine: dict) -> torch.device:
    if mine:
        return next(iter(mine.values())).load.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def summary(names: list[str], counts: torch.Tensor, ep: int) -> dict:
    """counts [layers, E] -> {layer: {max_over_mean, ep_max_over_mean, hottest}}: the busiest
    expert's and the busiest ep rank's load over their means (1 = balanced), the hottest ids."""
    out: dict[str, dict | None] = {}
    for name, row in zip(names, counts, strict=True):
        if row.sum() == 0:  # the layer did not run in the interval
            out[name] = None
            continue
        per_rank = row.view(ep, -1).sum(1)  # [ep] rows the experts of each ep rank got
        out[name] = {
            "max_over_mean": round(float(row.max() / row.mean()), 4),
            "ep_max_over_mean": round(float(per_rank.max() / per_rank.mean()), 4),
            "hottest": row.topk(min(HOTTEST, row.numel())).indices.tolist(),
        }
    return out
