"""The model's weights under their Hugging Face names, one full tensor at a time, from any folding:
what an inference engine loads between RL steps (vLLM's `load_weights(iterable)`), and a Hub folder.

    stream = HFWeights(model_parts, model_args, family, pp_mesh)    collective: the plan, agreed over pp
    for name, tensor in stream.tensors(dst=0):                      collective: every rank iterates it
        ...                                                         only rank dst gets tensors

The names and tensors are the HF export's (`python -m titan_fold.hf export`): each group of
our tensors goes through the family's state-dict adapter (models/hf_adapter.py), which splits
the stacked experts and renames. A group is one transformer block (`layers.{i}`), the embedding,
or the final norm with the output head, in the model's order.

Folding. A parameter is a DTensor on the attention mesh (tp, FSDP over dp_shard x cp) or on
the expert mesh (ep x etp, FSDP over edp); `full_tensor()` gathers it over the ranks of its
pipeline stage, and all of them take part. Under pp a group lives on one stage: that stage's
ranks gather it, then each tensor reaches the other stages over the pp group (a broadcast, or
one send to rank dst). The other stages know each tensor's name, shape and dtype from the plan,
made before any gather: each stage's groups, their tensors' shapes and dtypes, exchanged once
over pp, converted by the adapter on meta tensors.

Memory. One group is gathered at a time and dropped before the next: a rank holds at most one
block's full tensors (or the embedding, or the head), plus what the adapter's conversion copies
of them (the routed experts, split per expert) and what the consumer keeps.
"""

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_fold.checkpoint.files import check_out_folder, nonzero_expert_bias, write_hf_folder
from titan_fold.checkpoint.hf import cast_weights
from titan_fold.common.errors import UserError
from titan_fold.common.tensors import model_fqn
from titan_fold.models.hf_adapter import ADAPTERS, hf_config

_BLOCK = re.compile(r"layers\.(\d+)\.")


class NotExportable(UserError):
    """A model the HF adapter cannot name (family, MTP layers): said before any work."""


def check_exportable(family: str, mtp_layers: int = 0) -> None:
    """One line when the model has no Hugging Face form the stream can give."""
    if family not in ADAPTERS:
        raise NotExportable(
            f"model.name = {family!r}: Hugging Face names exist for {', '.join(sorted(ADAPTERS))} only; "
            "nothing to stream"
        )
    if mtp_layers:
        raise NotExportable(
            f"mtp.num_layers = {mtp_layers}: the weight stream has no Multi-Token Prediction layers "
            "(inference engines skip them); export them with python -m titan_fold.hf export"
        )


def group_of(name: str) -> tuple[int, int]:
    """The group of one of our tensor names, as its place in the model's order."""
    m = _BLOCK.match(name)
    if m is not None:
        return (1, int(m.group(1)))
    return (0, 0) if name.startswith("tok_embeddings.") else (2, 0)


def _full(t: torch.Tensor) -> torch.Tensor:
    # a DTensor's gather runs over the ranks of its mesh: this pipeline stage's
    return t.full_tensor() if isinstance(t, DTensor) else t


class HFWeights:
    """The HF tensors of a (folded) model, streamed one at a time. Building it is collective over
    pp (every rank), and so is each pass of `tensors`.

    plan: [(group, owner pp rank, {hf name: meta tensor})] in the model's order, the same on
    every rank; `planned` the HF names, shapes and dtypes in the order the stream gives them.
    """

    def __init__(self, model_parts, model_args, family: str, pp_mesh=None, dtype: torch.dtype | None = None):
        check_exportable(family, model_args.mtp_layers)
        self.adapter = ADAPTERS[family](model_args)
        self.family, self.model_args, self.dtype = family, model_args, dtype
        self.local: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for part in model_parts:
            for key, value in part.state_dict().items():
                name = model_fqn(key)
                self.local.setdefault(group_of(name), {})[name] = value
        self.device = next(iter(next(iter(self.local.values())).values())).device
        self.pp_group = pp_mesh.get_group() if pp_mesh is not None else None
        self.pp_rank = pp_mesh.get_local_rank() if pp_mesh is not None else 0
        mine = {g: [(n, list(t.shape), t.dtype) for n, t in sd.items()] for g, sd in self.local.items()}
        stages: list[Any] = [mine]
        if self.pp_group is not None:
            stages = [None] * pp_mesh.size()
            dist.all_gather_object(stages, mine, group=self.pp_group)
        owners: dict[tuple[int, int], tuple[int, list]] = {}
        for stage, groups in enumerate(stages):
            for g, tensors in groups.items():
                owners[g] = (stage, tensors)
        self.plan: list[tuple[tuple[int, int], int, dict[str, torch.Tensor]]] = []
        for g in sorted(owners):
            stage, tensors = owners[g]
            native = {n: torch.empty(shape, dtype=dt, device="meta") for n, shape, dt in tensors}
            self.plan.append((g, stage, self.adapter.to_hf(cast_weights(native, dtype))))
        self.planned = {k: v for _, _, hf in self.plan for k, v in hf.items()}
        self._check_biases()

    def _check_biases(self) -> None:
        """Non-zero aux-free biases of a family whose HF model has none: refused on every rank."""
        local = {k: v for sd in self.local.values() for k, v in sd.items() if k.endswith("router.expert_bias")}
        found = nonzero_expert_bias(
            {k: v.to_local() if isinstance(v, DTensor) else v for k, v in local.items()}, self.family
        )
        flag = torch.tensor([float(found is not None)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise UserError(
                f"the aux-free router biases are not zero{f' ({found}, ...)' if found else ''}: the Hugging Face "
                f"{self.family} model has no place for them and would route differently; nothing was streamed"
            )

    def tensors(self, dst: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in the plan's order. dst None: every rank gets every tensor; a
        rank: only that rank gets them, and the others' iterators yield nothing, but they must
        still be run to the end (their ranks gather and send): e.g. `for _ in stream: pass`."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        here = dst is None or dst == rank
        pp_ranks = dist.get_process_group_ranks(self.pp_group) if self.pp_group is not None else [rank]
        for g, owner, hf_meta in self.plan:
            if owner == self.pp_rank:
                native = {n: _full(t).detach() for n, t in self.local[g].items()}
                hf = self.adapter.to_hf(cast_weights(native, self.dtype))
                del native
            else:
                hf = dict.fromkeys(hf_meta)  # filled as each tensor arrives
            for name, meta in hf_meta.items():
                t = hf.pop(name)
                if self.pp_group is not None:
                    t = self._transfer(t, meta, pp_ranks[owner], dst, pp_ranks)
                if here:
                    yield name, t
                del t

    def _transfer(self, t, meta: torch.Tensor, src: int, dst: int | None, pp_ranks: list[int]):
        """One tensor from its stage's rank src (global) of this pp group to the ranks that want it:
        every rank of the group (dst None), or dst alone; None where it does not go."""
        rank = dist.get_rank()
        if dst is not None and (dst not in pp_ranks or dst == src or rank not in (src, dst)):
            return t if rank == src else None  # already there, or not wanted here
        if rank == src:
            t = t.contiguous()
        else:
            t = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        if dst is None:
            dist.broadcast(t, src=src, group=self.pp_group)
        elif rank == src:
            dist.send(t, dst=dst)
        else:
            dist.recv(t, src=src)
        return t


def hf_weights(
    model_parts, model_args, family: str, pp_mesh=None, dst: int | None = None, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the model, one at a time (HFWeights: folding, memory). Every rank
    calls it and runs the iterator to the end. dst None: every rank gets every tensor; a rank:
    only that rank does (vLLM's `load_weights` on rank 0). dtype: floating weights cast as
    `python -m titan_fold.hf export --dtype` casts them."""
    return HFWeights(model_parts, model_args, family, pp_mesh, dtype).tensors(dst)


def save_hub(
    model_parts,
    model_args,
    family: str,
    folder: str,
    pp_mesh=None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """A Hub folder (config.json + safetensors, the HF export's writer) of the model, written by
    rank 0 from the stream. Collective. A folder that exists and is not empty is refused on every
    rank before any gather (nothing saved is lost)."""
    check_out_folder(folder)
    stream = HFWeights(model_parts, model_args, family, pp_mesh, dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    config = hf_config(family, model_args)
    write_hf_folder(stream.planned, stream.tensors(dst=0), folder, config, max_shard_bytes, write=rank == 0)
