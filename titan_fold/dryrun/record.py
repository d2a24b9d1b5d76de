"""Recording the collectives of one training step of a shrunk model on every simulated rank."""

import contextlib
import copy
import dataclasses
import math
import os
import time
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist

from titan_fold.common.moe_config import batch_overlap
from titan_fold.common.tensors import local
from titan_fold.compat.dispatch import TorchDispatchMode, is_boxed_group, op_name, tree_leaves, wait_tensor
from titan_fold.compat.distributed import resolve_process_group
from titan_fold.data.rollouts import RoutingShape, stand_in_fields
from titan_fold.dryrun.measure import _dry_config
from titan_fold.dryrun.step import StepTrainer
from titan_fold.dryrun.world import SharedShardingDecisions, init_fake_world
from titan_fold.parallel.pipeline import stage_fqns
from titan_fold.trainer.preflight import layout_from_config

P2P = "p2p"  # the group name under which a pair of ranks' send/recv are recorded


class CollectiveRecorder(TorchDispatchMode):
    """Every collective this process issues: per process group, its kind, shapes and call
    site; point-to-point send/recv (the pipeline's) per pair of ranks, under the key
    (P2P, (lower rank, higher rank)), with the peer's global rank.

    A fake process group delivers nothing: a received buffer is filled with ones, so that
    the pipeline schedule's start-up vote (torch 2.13: every stage sends the product of
    the stages' "shapes given up front" flags) reads what the real peers would send."""

    PREFIXES = ("_c10d_functional.", "c10d.")
    SKIP = ("wait_tensor", "barrier", "monitored_barrier")
    P2P_OPS = {"send": "send", "recv_": "recv"}

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.calls: dict[tuple, list[dict]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        recorded = name.startswith(self.PREFIXES) and not any(s in name for s in self.SKIP)
        if recorded:
            self._record(name, func, args, kwargs)
        out = func(*args, **kwargs)
        if recorded and name == "c10d.recv_":
            for t in args[0]:
                t.fill_(1)
        if name.startswith("_c10d_functional.") and "wait_tensor" not in name:
            # a fake collective is done when issued; its work never reports completion, so one
            # whose output the code drops unread would stay registered and torch would warn
            # of "unwaited collective calls" at exit
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    wait_tensor(t)
        return out

    def _record(self, name, func, args, kwargs):
        group, shapes, ints = None, [], []
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, str):  # functional collectives: the group's name comes last
                group = a
            elif isinstance(a, dist.ProcessGroup):
                group = a
            elif is_boxed_group(a):
                group = dist.ProcessGroup.unbox(a)  # c10d ops (FSDP2, pipelining) carry the group boxed
            elif isinstance(a, torch.Tensor):
                shapes.append((tuple(local(a).shape), str(a.dtype).removeprefix("torch.")))
            elif isinstance(a, int) and not isinstance(a, bool):
                ints.append(a)
        if group is None:
            return
        if isinstance(group, str):
            group = resolve_process_group(group)
        ranks = tuple(dist.get_process_group_ranks(group))
        if len(ranks) < 2:
            return
        op = name.split(".", 1)[1]
        if op in self.P2P_OPS:  # c10d.send / recv_(tensors, group, peer's rank in the group, tag)
            peer = ranks[ints[0]]
            self.calls[(P2P, tuple(sorted((self.rank, peer))))].append(
                {"op": self.P2P_OPS[op], "peer": peer, "shapes": shapes, "ints": ints, "site": call_site()}
            )
            return
        desc = getattr(group, "group_desc", "") or ""
        self.calls[(desc, ranks)].append({"op": op, "shapes": shapes, "ints": ints, "site": call_site()})


# the package's own folder, wherever it lives: matching "/titan_fold/" in a path would also
# take torch's files in a clone named titan_fold that holds its .venv
DRYRUN = os.path.dirname(os.path.abspath(__file__)) + os.sep
PACKAGE = os.path.dirname(os.path.dirname(DRYRUN)) + os.sep  # titan_fold/


def in_package(filename: str) -> bool:
    return os.path.abspath(filename).startswith(PACKAGE)


def ours(filename: str) -> bool:
    """A frame of titan_fold's code, not of the dry run itself."""
    return in_package(filename) and not os.path.abspath(filename).startswith(DRYRUN)


def where(filename: str) -> str:
    """A file relative to the package (`moe/dispatcher.py`), or to site-packages (`torch/...`)."""
    path = os.path.abspath(filename)
    return os.path.relpath(path, PACKAGE) if in_package(path) else path.split("/site-packages/", 1)[-1]


def call_site() -> str:
    """The innermost titan_fold frame and the torch subsystem that issued the collective."""
    stack = traceback.extract_stack()[:-3]
    mine = next((f for f in reversed(stack) if ours(f.filename)), None)
    torch_part = next(
        (
            f
            for f in reversed(stack)
            if "/torch/distributed/" in f.filename
            and not any(s in f.filename for s in ("_python_dispatch", "_functional_collectives", "distributed_c10d"))
        ),
        None,
    )
    parts = []
    if mine is not None:
        parts.append(f"{where(mine.filename)}:{mine.lineno} {mine.name}")
    if torch_part is not None:
        parts.append(f"torch/distributed/{torch_part.filename.split('/torch/distributed/', 1)[1]}:{torch_part.lineno}")
    return " via ".join(parts) or "?"


def _signature(call: dict) -> tuple:
    """What all members of a group must agree on: the op, dtypes, and the shapes except the
    row count of uneven (v) collectives, whose splits differ by rank."""
    uneven = call["op"].startswith("all_to_all") or call["op"].startswith("alltoall")
    return call["op"], tuple((shape[1:] if uneven else shape, dtype) for shape, dtype in call["shapes"])


def _p2p_signature(call: dict) -> tuple:
    """What a send and its recv must agree on: dtypes and shapes, sizes of one left out
    (the bytes in memory order: torch's own first exchange sends a [] into a [1])."""
    return tuple((tuple(n for n in shape if n != 1), dtype) for shape, dtype in call["shapes"])


def shrunk_config(job_config, model_args, world_size: int | None = None):
    """The same job at the same layout with a tiny model: same experts, top-k and heads,
    widths of a few units, as few layers as the pipeline split allows; one gradient
    accumulation step, the shortest valid sequence. With the world size, a width FSDP2
    shards the experts on (fewer experts per rank than edp ranks) splits edp ways, and
    moe.ep_overlap's batch overlap gets its pair of micro-batches (under pp: a pipeline steady state)."""

    config = _dry_config(job_config)
    par, tr = config.parallelism, config.training
    args = copy.deepcopy(model_args)
    if par.pipeline_parallel_degree > 1 and par.module_fqns_per_model_part is None:
        stages = len(stage_fqns(par, args.n_layers, par.pipeline_parallel_degree))
        n_layers = stages if par.pipeline_parallel_layers_per_stage is None else args.n_layers
    else:
        n_layers = args.n_layers if par.module_fqns_per_model_part else 2
    etp = par.expert_tensor_parallel_degree
    tp = par.tensor_parallel_degree
    args.n_layers = n_layers
    if args.layer_types:
        # each kept layer's own mixer, unless that leaves a kind out (Qwen3.5's first layers are all
        # linear attention): then the kinds in turn
        kept, kinds = args.layer_types[:n_layers], list(dict.fromkeys(args.layer_types))
        args.layer_types = kept if set(kept) == set(kinds) else tuple(kinds[i % len(kinds)] for i in range(n_layers))
    if hasattr(args, "linear_key_head_dim"):  # linear attention: the head counts kept, 4 wide each
        args.linear_key_head_dim = args.linear_value_head_dim = 4
    if args.sliding_window:  # a window the short sequence below passes
        args.sliding_window = min(args.sliding_window, 4)
    if hasattr(args, "kv_lora_rank"):  # MLA: latents and per-head widths of a few units (head_dim 4 below)
        args.q_lora_rank = None if args.q_lora_rank is None else 4
        args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim = 4, 2, 2, 4
    args.head_dim = max(4, round(2 / args.partial_rotary_factor))  # RoPE on an even number of dims
    args.dim = 4 * args.n_heads
    layout = layout_from_config(config, world_size) if world_size is not None else None
    if layout is not None and args.moe.num_experts // layout.ep < layout.edp:
        args.dim = math.lcm(args.dim, layout.edp)
    args.ffn_dim = 8 * tp
    args.vocab_size = max(512, 16 * tp)
    args.moe = dataclasses.replace(
        args.moe, moe_ffn_dim=8 * etp, shared_ffn_dim=8 * tp if args.moe.shared_ffn_dim else 0
    )
    cp = par.context_parallel_degree
    step = (2 * cp if cp > 1 else 1) * tp
    tr.seq_len = step * max(1, math.ceil(8 / step))
    args.max_seq_len = tr.seq_len  # the rotary tables of every stage: no longer than used
    dp = (
        par.data_parallel_replicate_degree * par.data_parallel_shard_degree
        if par.data_parallel_shard_degree > 0
        else None
    )
    tr.global_batch_size = -1 if dp is None else tr.local_batch_size * dp
    if layout is not None and batch_overlap(args.moe.ep_overlap) and layout.pp > 1:
        # 2 pp pipeline micro-batches: (backward, forward) pairs on every pp rank of either schedule
        tr.local_batch_size = 2 * layout.pp * par.pipeline_parallel_microbatch_size
        tr.global_batch_size = tr.local_batch_size * layout.dp
    elif layout is not None and batch_overlap(args.moe.ep_overlap):  # micro-batches overlapped in pairs: a step of two
        tr.global_batch_size = 2 * tr.local_batch_size * layout.dp
    return config, args


# seconds between two progress lines of the collective phase (minutes at hundreds of ranks)
PROGRESS_EVERY = 10.0


def record_collectives(job_config, world_size: int, model_args, ranks=None, watch=None, progress=None) -> dict:
    """One training step of the shrunk model on every rank (or `ranks`) of a fake world;
    watch(trainer, layout, rank): a context each rank's step runs in (the gradient check);
    progress(line): the ranks recorded so far, every PROGRESS_EVERY seconds and at the end.

    -> {(group desc, group ranks): {rank: [call, ...]}}"""
    config, args = shrunk_config(job_config, model_args, world_size)
    per_group: dict[tuple, dict[int, list]] = defaultdict(dict)
    ranks = list(ranks if ranks is not None else range(world_size))
    last = time.monotonic()
    with SharedShardingDecisions.installed():
        for done, rank in enumerate(ranks, 1):
            for key, calls in step_collectives(config, args, world_size, rank, watch).items():
                per_group[key][rank] = calls
            if progress is not None and (done == len(ranks) or time.monotonic() - last >= PROGRESS_EVERY):
                progress(f"collectives recorded on {done} of {len(ranks)} ranks")
                last = time.monotonic()
    for (desc, pair), by_rank in per_group.items():
        if desc == P2P:  # a simulated rank that sent or received nothing to its peer
            for r in set(pair) & set(ranks):
                by_rank.setdefault(r, [])
    return per_group


def step_collectives(config, model_args, world_size: int, rank: int, watch=None) -> dict:
    """The collectives `rank` issues in one training step of FoldTrainer (forward, backward,
    gradient clipping, optimizer step, loss logging), recorded per process group."""
    init_fake_world(world_size, rank)
    layout = layout_from_config(config, world_size)
    layout.build_mesh("cpu")
    trainer = StepTrainer(config, layout, model_args)
    b, S = config.training.local_batch_size, config.training.seq_len
    tokens = torch.randint(0, model_args.vocab_size, (b, S), generator=torch.Generator().manual_seed(rank))
    observed = watch(trainer, layout, rank) if watch is not None else contextlib.nullcontext()
    with observed, CollectiveRecorder(rank) as recorder:
        try:
            batch = {"input": tokens}
            if config.training.dataset_format == "rollouts":  # the policy loss reads them
                batch |= stand_in_fields(b, S, RoutingShape.of(model_args))
            trainer.train_step(iter([(batch, tokens.clone())] * trainer.gradient_accumulation_steps))
        except Exception as e:  # where a real run of this layout would fail too
            raise StepFailed(rank, e) from e
    return dict(recorder.calls)


class StepFailed(Exception):
    """The training step of a simulated rank raised: its first cause and where."""

    def __init__(self, rank: int, error: BaseException):
        while error.__cause__ is not None:  # the pipeline schedule wraps the stage's own error
            error = error.__cause__
        frames = traceback.extract_tb(error.__traceback__)
        mine = [f for f in frames if in_package(f.filename)]
        site = mine[-1] if mine else frames[-1]
        self.report = {
            "rank": rank,
            "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}",
            "site": f"{where(site.filename)}:{site.lineno} {site.name}",
            "innermost": f"{where(frames[-1].filename)}:{frames[-1].lineno}",
        }
        super().__init__(f"rank {rank}: {self.report['error']} at {self.report['site']}")
