"""Dry run: check a job config at its real world size on one CPU, before the cluster.

    NGPU=64 python -m titan_fold.train --job.config_file qwen2.toml --comm.mode fake_backend

torchtitan's `--comm.mode fake_backend` (a fake process group of NGPU ranks in one process)
runs this instead of training. For the simulated rank (`--comm.dry_run_rank R`, default 0;
-1: the first and the last rank of every pipeline stage) it
- checks the config as a real run does (titan_fold.train.check_layout);
- builds both meshes on the fake process group and reads off the rank's coordinates;
- builds the model on the meta device and applies the trainer's own pipeline split and
  parallelize (TP/SP, CP, EP x ETP, FSDP2 on both meshes): local shapes, no storage;
- counts the bytes of parameters, gradients and optimizer states of the rank;
- runs one micro-batch forward and backward of the rank's stages under fake tensors
  (shapes only, in the compute dtype) and measures the activations autograd keeps;
- puts the cost model's estimate for the same mapping beside it (titan_fold.cost_model).
Then (`--comm.dry_run_collectives`, default on) every rank runs one training step of a
shrunk model (same layout, same experts and heads, tiny widths, few layers; under PP the real
pipeline schedule) while every collective is recorded per process group and every pipeline
send/recv per pair of ranks; all members of a group must issue the same sequence and every
send must meet its recv, else the first divergence is reported (the mismatch that hangs a
real job); a step that raises on a rank is reported with its cause.
Output: a table on stdout and `<job.dump_folder>/dry_run.json`.
"""

import contextlib
import copy
import dataclasses
import json
import math
import os
import time
import traceback
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from titan_fold import cost_model
from titan_fold.errors import UserError
from titan_fold.parallel.mesh import ATTENTION_DIMS, EXPERT_DIMS, Layout
from titan_fold.parallel.parallelize import op_sac_problem

GIB = 1024**3
# optimizer states per parameter, in the parameter's dtype
OPTIMIZER_STATES = {"Adam": 2, "AdamW": 2, "SGD": 0}
DIFF_NOTE = 0.10  # differences beyond this fraction get an explanation


def _bytes_of(dtype_name: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


# ---------------------------------------------------------------- ranks and positions


def init_fake_world(world_size: int, rank: int) -> None:
    """A fake process group of world_size ranks in which this process is `rank`."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_dtensor_decisions()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _forget_dtensor_decisions() -> None:
    # DTensor caches sharding and redistribution decisions keyed by mesh *value*; the next
    # simulated rank's meshes equal the last one's by value but hold other process groups
    from torch.distributed.tensor import _redistribute

    prop = DTensor._op_dispatcher.sharding_propagator
    for cached in (prop.propagate_op_sharding, getattr(prop, "_propagate_tensor_meta_cached", None),
                   getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ dispatch fast path's
        torch._C._clear_DTensor_sharding_propagator_cache()


class SharedShardingDecisions:
    """DTensor's sharding propagation of one op schema, computed once for all simulated ranks.

    Every rank's meshes are new objects (its own process groups), equal by value to the other
    ranks' (DeviceMesh compares shape, ranks and dim names; not the coordinate): DTensor's own
    caches would hand a rank the meshes of the rank that filled them, and are cleared per rank.
    Here a decision made for an earlier rank is handed out with that rank's meshes replaced by
    this schema's. Propagation reads the mesh's shape only (torch's tensor/_ops and
    _sharding_prop never ask a mesh for its coordinate, rank or groups), so the decision is
    the one this rank would compute; redistribution plans (coordinate-dependent local shapes)
    are still cleared per rank."""

    def __init__(self, compute):
        self.compute = compute
        self.known: dict = {}  # OpSchema, by value -> (the schema it was computed for, decision)

    def __call__(self, op_schema):
        hit = self.known.get(op_schema)
        if hit is None:
            out = self.compute(op_schema)
            self.known[op_schema] = (op_schema, out)
            return out
        then, out = hit
        meshes = {id(a): b for a, b in zip(_meshes(then), _meshes(op_schema)) if a is not b}
        return _rebind(out, meshes) if meshes else out

    @staticmethod
    @contextlib.contextmanager
    def installed():
        prop = DTensor._op_dispatcher.sharding_propagator
        prop.propagate_op_sharding_non_cached = SharedShardingDecisions(prop.propagate_op_sharding_non_cached)
        try:
            yield
        finally:
            del prop.propagate_op_sharding_non_cached  # the class's method again


def _rebind(x, meshes: dict):
    """x with every DTensorSpec's mesh replaced through `meshes` (id -> mesh); the rest (the
    placements included: a _MaskPartial carries the embedding's mask from its op to the
    reduction, as in one process) shared."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

    if isinstance(x, DTensorSpec):
        return dataclasses.replace(x, mesh=meshes.get(id(x.mesh), x.mesh))
    if isinstance(x, OutputSharding):
        return dataclasses.replace(x, output_spec=_rebind(x.output_spec, meshes),
                                   redistribute_schema=_rebind(x.redistribute_schema, meshes))
    if isinstance(x, OpSchema):
        return dataclasses.replace(x, args_schema=_rebind(x.args_schema, meshes),
                                   kwargs_schema=_rebind(x.kwargs_schema, meshes))
    if isinstance(x, (tuple, list)):
        return type(x)(_rebind(a, meshes) for a in x)
    if isinstance(x, dict):
        return {k: _rebind(v, meshes) for k, v in x.items()}
    return x


def _meshes(op_schema) -> list:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return [a.mesh for a in tree_leaves((op_schema.args_schema, op_schema.kwargs_schema))
            if isinstance(a, DTensorSpec)]


def positions(layout: Layout) -> list[int]:
    """One rank per distinct position: the first and the last rank of every pipeline stage
    (the last holds the last dp / ep / etp coordinate, where uneven FSDP shards are smallest)."""
    per_stage = layout.world_size // layout.pp
    return sorted({r for p in range(layout.pp) for r in (p * per_stage, (p + 1) * per_stage - 1)})


def coordinates(layout: Layout) -> dict:
    att = dict(zip(ATTENTION_DIMS, layout.attention.get_coordinate()))
    exp = dict(zip(EXPERT_DIMS, layout.expert.get_coordinate()))
    return {"attention": att, "expert": exp}


# ---------------------------------------------------------------- parameters


def param_kind(fqn: str) -> str:
    if ".moe.experts." in fqn:
        return "routed experts"
    for key, kind in ((".moe.router.", "router"), (".moe.shared_expert", "shared expert"),
                      (".attention.", "attention"), (".feed_forward.", "dense ffn"),
                      ("tok_embeddings.", "embedding"), ("output.", "output head")):
        if key in fqn or fqn.startswith(key):
            return kind
    return "norms"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def parameter_report(model_parts: list[nn.Module], job_config) -> dict:
    """Local shapes by kind and the bytes of params, grads and optimizer states of this rank."""
    master = _bytes_of(job_config.training.dtype)  # master weights, their gradients and states
    states = OPTIMIZER_STATES.get(job_config.optimizer.name, 2)
    kinds: dict[str, dict] = {}
    numel = 0
    for part in model_parts:
        for fqn, p in part.named_parameters():
            shape = tuple(local_tensor(p).shape)
            n = math.prod(shape)
            numel += n
            k = kinds.setdefault(param_kind(fqn), {"numel": 0, "shapes": {}})
            k["numel"] += n
            name = fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            name = name.split(".", 2)[-1] if name.startswith("layers.") else name
            k["shapes"].setdefault(name, shape)
    return {
        "numel": numel,
        "bytes": {"params": numel * master, "grads": numel * master, "optimizer": numel * master * states},
        "kinds": kinds,
    }


# ---------------------------------------------------------------- activations under fake tensors


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive (and the peak)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = 0, 0
        self.sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = local_tensor(t).untyped_storage()
                key = st._cdata
                if key not in self.sizes:
                    self.sizes[key] = st.nbytes()
                    self.live += self.sizes[key]
                    weakref.finalize(st, self._free, key)
        self.peak = max(self.peak, self.live)
        return out

    def bytes_of(self, tensors) -> int:
        keys = {local_tensor(t).untyped_storage()._cdata for t in tensors}
        return sum(self.sizes.get(k, 0) for k in keys)


def fake_step(model_parts: list[nn.Module], stages: list, layout: Layout, job_config, model_args) -> dict:
    """One micro-batch forward + backward of every stage of this rank under FakeTensorMode.

    -> {"per_microbatch": bytes kept for backward by all of this rank's stages,
        "peak": most bytes alive during forward + backward (activations, gathered parameters,
        gradients), "unsharded": gathered parameters still held after forward}.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.parallel import loss_parallel

    tr = job_config.training
    mb = job_config.parallelism.pipeline_parallel_microbatch_size if layout.pp > 1 else tr.local_batch_size
    S = tr.seq_len // layout.cp
    compute_dtype = getattr(torch, tr.mixed_precision_param)
    kept = peak = unsharded = 0
    with FakeTensorMode(allow_non_fake_inputs=True):
        for part, stage in zip(model_parts, stages):
            part.to_empty(device="cpu")  # values do not matter: shapes only (no init_weights)
            first, last = part.embeds_tokens, part.output is not None
            if first:
                x = torch.zeros(mb, S, dtype=torch.int64)
            else:  # a later stage gets this rank's sequence shard of the hidden states
                x = torch.zeros(mb, S // layout.tp, model_args.dim, dtype=compute_dtype, requires_grad=True)
            positions = torch.arange(S) if layout.cp > 1 else None
            tracker = LiveBytes()
            lp = loss_parallel() if last and layout.tp > 1 and not job_config.parallelism.disable_loss_parallel \
                else contextlib.nullcontext()
            with tracker, lp:
                out = part(x, positions=positions)
                if last:
                    labels = torch.zeros(mb, S, dtype=torch.int64)
                    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.flatten(), reduction="sum")
                else:
                    loss = None
                held = tracker.bytes_of(p for p in part.parameters())
                unsharded += held
                kept += tracker.live - held
                if last:
                    loss.backward()
                else:
                    out.backward(torch.ones_like(out))
                del out, loss
            peak = max(peak, tracker.peak)
    return {"per_microbatch": kept, "peak": peak, "unsharded": unsharded}


def _cast_default_dtype(dtype: torch.dtype):
    @contextlib.contextmanager
    def ctx():
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(before)

    return ctx()


# ---------------------------------------------------------------- building one rank


def build_rank(job_config, layout: Layout, model_args, dtype: torch.dtype = torch.float32):
    """The trainer's model construction for this rank, on the meta device:
    -> (model_parts, stage indices, every stage's module FQNs, pipeline schedule or None)."""
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_fold.parallel.pipeline import check_pipeline, pipeline
    from titan_fold.train_spec import register_train_specs

    register_train_specs()
    spec = get_train_spec(job_config.model.name)
    with torch.device("meta"), _cast_default_dtype(dtype):
        model = spec.model_cls(model_args)
    if layout.pp > 1:
        _, all_fqns, _ = check_pipeline(job_config, model_args, layout.pp)
        schedule, parts, _, _ = pipeline(model, layout, job_config, torch.device("cpu"), model_args,
                                         spec.parallelize_fn, spec.build_loss_fn(job_config))
        pp_rank = layout.get_mesh("pp").get_local_rank()
        stages = list(range(pp_rank, len(all_fqns), layout.pp))
    else:
        all_fqns = [["tok_embeddings", *(f"layers.{i}" for i in range(model_args.n_layers)), "norm", "output"]]
        parts, stages, schedule = [spec.parallelize_fn(model, layout, job_config)], [0], None
    return parts, stages, all_fqns, schedule


def _dry_config(job_config):
    """The config the meta build runs with: compile off (a dry run compiles nothing)."""
    config = copy.deepcopy(job_config)
    config.compile.enable = False
    return config


def simulate_rank(job_config, world_size: int, rank: int, model_args, measure: bool = True) -> dict:
    from titan_fold.parallel.pipeline import format_stages
    from titan_fold.train import layout_from_config

    t0 = time.process_time()
    init_fake_world(world_size, rank)
    layout = layout_from_config(job_config, world_size)
    layout.build_mesh("cpu")
    config = _dry_config(job_config)
    # built once, in the compute dtype the fake step needs: the counts do not depend on it
    compute = getattr(torch, job_config.training.mixed_precision_param)
    parts, stages, all_fqns, _ = build_rank(config, layout, model_args, compute if measure else torch.float32)
    report = {
        "rank": rank,
        "coordinates": coordinates(layout),
        "stages": [{"index": s, "of": len(all_fqns), "modules": format_stages([all_fqns[s]], 1).split(": ", 1)[1]}
                   for s in stages],
        **parameter_report(parts, job_config),
    }
    report["moe_layers"] = sum(1 for part in parts for b in part.layers.values() if b.moe_enabled)
    report["dense_layers"] = sum(1 for part in parts for b in part.layers.values() if not b.moe_enabled)
    if measure:
        try:
            report["activations"] = {"source": "fake-tensor step", **fake_step(parts, stages, layout, config, model_args)}
        except Exception as e:  # reported; the cost model's estimate stands in
            report["activations"] = {"source": "cost model estimate (the fake-tensor step failed: "
                                               f"{type(e).__name__}: {str(e).splitlines()[0][:200]})"}
            report["activations"]["traceback"] = "".join(line for line in traceback.format_exc().splitlines(True) if "titan_fold" in line)
    report["cpu_seconds"] = round(time.process_time() - t0, 2)
    return report


# ---------------------------------------------------------------- the cost model beside it


def cost_model_estimate(job_config, layout: Layout, model_args) -> tuple[cost_model.Memory, dict]:
    tr, par = job_config.training, job_config.parallelism
    ac = job_config.activation_checkpoint
    mapping = cost_model.Mapping(layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.ep,
                                 layout.etp, layout.edp, recompute=ac.mode if ac.mode in cost_model.RECOMPUTE else "none")
    micro = par.pipeline_parallel_microbatch_size if layout.pp > 1 else tr.local_batch_size
    work = cost_model.Workload(tr.seq_len, tr.global_batch_size if tr.global_batch_size > 0 else tr.local_batch_size * layout.dp,
                               job_config.moe.capacity_factor, compute_bytes=_bytes_of(tr.mixed_precision_param),
                               micro_batch=micro)
    sizes = cost_model.model_sizes(model_args, tr.seq_len, f"{job_config.model.name}/{job_config.model.flavor}")
    return cost_model.memory(sizes, mapping, work), {
        "layers_per_stage": cost_model._layers_per_stage(sizes, layout.pp),
        "in_flight": min(layout.pp, work.microbatches(layout.dp)) if layout.pp > 1 else 1,
        "pipeline_microbatches": tr.local_batch_size // micro if layout.pp > 1 else 1,
    }


def compare(rank_report: dict, est: cost_model.Memory, info: dict, layout: Layout) -> list[dict]:
    """Rows (what, dry run bytes, cost model bytes, note) with an explanation past 10%."""
    b = rank_report["bytes"]
    acts = rank_report.get("activations", {})
    layers = rank_report["moe_layers"] + rank_report["dense_layers"]
    assumed = info["layers_per_stage"]["moe"] + info["layers_per_stage"]["dense"]
    layer_note = (f"this rank holds {layers} blocks, the cost model's busiest stage ceil(layers / pp) = {assumed}"
                  f"{'' if len(rank_report['stages']) == 1 else ' (one stage per pp rank; here interleaved stages)'}")
    rows = [("params", b["params"], est.params, layer_note),
            ("grads", b["grads"], est.grads, layer_note),
            ("optimizer", b["optimizer"], est.optimizer, layer_note)]
    if "per_microbatch" in acts:
        # 1F1B: pp rank p holds min(pp - p, micro-batches) forwards before its first backward
        pp_rank = rank_report["coordinates"]["attention"]["pp"]
        flight = min(layout.pp - pp_rank, info["pipeline_microbatches"])
        measured = acts["per_microbatch"] * flight
        why = []
        if flight != info["in_flight"]:
            why.append(f"{flight} micro-batch(es) in flight here (pipeline micro-batches of this config: "
                       f"{info['pipeline_microbatches']}), the cost model assumes {info['in_flight']} "
                       f"(global batch / dp sequences, one per micro-batch)")
        per_mb = est.activations / info["in_flight"]
        why.append(f"per micro-batch {acts['per_microbatch'] / GIB:.2f} GiB measured against {per_mb / GIB:.2f} "
                   "GiB estimated: the fake step measures what autograd and the activation checkpointing policy "
                   "keep; the cost model counts an inventory of saved tensors per block (docs/planning.md), "
                   "and for selective recompute two ffn-wide tensors per block where torchtitan's op policy "
                   "recomputes every other matmul")
        note = "; ".join(why)
        rows.append(("activations", measured, est.activations + (est.logits if rank_report["stages"][-1]["index"]
                                                                   == rank_report["stages"][-1]["of"] - 1 else 0), note))
    out = []
    for what, mine, theirs, note in rows:
        diff = (mine - theirs) / theirs if theirs else 0.0
        out.append({"what": what, "dry_run": mine, "cost_model": theirs, "diff": diff,
                    "note": note if abs(diff) > DIFF_NOTE else ""})
    return out


# ---------------------------------------------------------------- collectives


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
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        recorded = name.startswith(self.PREFIXES) and not any(s in name for s in self.SKIP)
        if recorded:
            self._record(name, func, args, kwargs)
        out = func(*args, **kwargs)
        if recorded and name == "c10d.recv_":
            for t in args[0]:
                t.fill_(1)
        return out

    def _record(self, name, func, args, kwargs):
        group, shapes, ints = None, [], []
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, str):  # functional collectives: the group's name comes last
                group = a
            elif isinstance(a, dist.ProcessGroup):
                group = a
            elif isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                group = dist.ProcessGroup.unbox(a)  # c10d ops (FSDP2, pipelining) carry the group boxed
            elif isinstance(a, torch.Tensor):
                shapes.append((tuple(local_tensor(a).shape), str(a.dtype).removeprefix("torch.")))
            elif isinstance(a, int) and not isinstance(a, bool):
                ints.append(a)
        if group is None:
            return
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group)
        ranks = tuple(dist.get_process_group_ranks(group))
        if len(ranks) < 2:
            return
        op = name.split(".", 1)[1]
        if op in self.P2P_OPS:  # c10d.send / recv_(tensors, group, peer's rank in the group, tag)
            peer = ranks[ints[0]]
            self.calls[(P2P, tuple(sorted((self.rank, peer))))].append(
                {"op": self.P2P_OPS[op], "peer": peer, "shapes": shapes, "ints": ints, "site": call_site()})
            return
        desc = getattr(group, "group_desc", "") or ""
        self.calls[(desc, ranks)].append({"op": op, "shapes": shapes, "ints": ints, "site": call_site()})


def call_site() -> str:
    """The innermost titan_fold frame and the torch subsystem that issued the collective."""
    stack = traceback.extract_stack()[:-3]
    ours = next((f for f in reversed(stack) if "/titan_fold/" in f.filename and "dryrun.py" not in f.filename), None)
    torch_part = next((f for f in reversed(stack) if "/torch/distributed/" in f.filename and not any(
        s in f.filename for s in ("_python_dispatch", "_functional_collectives", "distributed_c10d"))), None)
    parts = []
    if ours is not None:
        parts.append(f"{ours.filename.split('/titan_fold/', 1)[1]}:{ours.lineno} {ours.name}")
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


def shrunk_config(job_config, model_args):
    """The same job at the same layout with a tiny model: same experts, top-k and heads,
    widths of a few units, as few layers as the pipeline split allows; one gradient
    accumulation step, the shortest valid sequence."""
    from titan_fold.parallel.pipeline import stage_fqns

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
    if hasattr(args, "kv_lora_rank"):  # MLA: latents and per-head widths of a few units (head_dim 4 below)
        args.q_lora_rank = None if args.q_lora_rank is None else 4
        args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim = 4, 2, 2, 4
    args.head_dim = 4
    args.dim = 4 * args.n_heads
    args.ffn_dim = 8 * tp
    args.vocab_size = max(512, 16 * tp)
    args.moe = dataclasses.replace(args.moe, moe_ffn_dim=8 * etp,
                                   shared_ffn_dim=8 * tp if args.moe.shared_ffn_dim else 0)
    cp = par.context_parallel_degree
    step = (2 * cp if cp > 1 else 1) * tp
    tr.seq_len = step * max(1, math.ceil(8 / step))
    args.max_seq_len = tr.seq_len  # the rotary tables of every stage: no longer than used
    dp = (par.data_parallel_replicate_degree * par.data_parallel_shard_degree
          if par.data_parallel_shard_degree > 0 else None)
    tr.global_batch_size = -1 if dp is None else tr.local_batch_size * dp
    return config, args


def record_collectives(job_config, world_size: int, model_args, ranks=None) -> dict:
    """One training step of the shrunk model on every rank (or `ranks`) of a fake world.

    -> {(group desc, group ranks): {rank: [call, ...]}}"""
    config, args = shrunk_config(job_config, model_args)
    per_group: dict[tuple, dict[int, list]] = defaultdict(dict)
    ranks = list(ranks if ranks is not None else range(world_size))
    with SharedShardingDecisions.installed():
        for rank in ranks:
            for key, calls in step_collectives(config, args, world_size, rank).items():
                per_group[key][rank] = calls
    for (desc, pair), by_rank in per_group.items():
        if desc == P2P:  # a simulated rank that sent or received nothing to its peer
            for r in set(pair) & set(ranks):
                by_rank.setdefault(r, [])
    return per_group


def step_collectives(config, model_args, world_size: int, rank: int) -> dict:
    """The collectives `rank` issues in one training step of FoldTrainer (forward, backward,
    gradient clipping, optimizer step, loss logging), recorded per process group."""
    from titan_fold.train import layout_from_config

    init_fake_world(world_size, rank)
    layout = layout_from_config(config, world_size)
    layout.build_mesh("cpu")
    trainer = _StepTrainer(config, layout, model_args)
    b, S = config.training.local_batch_size, config.training.seq_len
    tokens = torch.randint(0, model_args.vocab_size, (b, S), generator=torch.Generator().manual_seed(rank))
    with CollectiveRecorder(rank) as recorder:
        try:
            trainer.train_step(iter([({"input": tokens}, tokens.clone())]))
        except Exception as e:  # where a real run of this layout would fail too
            raise StepFailed(rank, e) from e
    return dict(recorder.calls)


class StepFailed(Exception):
    """The training step of a simulated rank raised: its first cause and where."""

    def __init__(self, rank: int, error: BaseException):
        while error.__cause__ is not None:  # the pipeline schedule wraps the stage's own error
            error = error.__cause__
        frames = traceback.extract_tb(error.__traceback__)
        ours = [f for f in frames if "/titan_fold/" in f.filename]
        site = ours[-1] if ours else frames[-1]
        where = site.filename.split("/titan_fold/", 1)[-1].split("/site-packages/", 1)[-1]
        self.report = {"rank": rank, "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}",
                       "site": f"{where}:{site.lineno} {site.name}", "innermost": f"{frames[-1].filename.split('/site-packages/', 1)[-1]}:{frames[-1].lineno}"}
        super().__init__(f"rank {rank}: {self.report['error']} at {self.report['site']}")


def _step_trainer_class():
    from titan_fold.guard import NonFiniteError, NonFiniteGuard, SkippedStep
    from titan_fold.train import FoldTrainer

    class _VerdictFreeGuard(NonFiniteGuard):
        """The guard's all-reduce is one of the step's collectives, but under a fake process
        group no reduced value is a real number (with torch 2.11 the gradient norm comes out
        NaN or Inf): its verdict is ignored."""

        def before_optimizer_step(self, *hook_args) -> None:
            try:
                super().before_optimizer_step(*hook_args)
            except (NonFiniteError, SkippedStep):
                pass

    class StepTrainer(FoldTrainer):
        """FoldTrainer's train_step and forward_backward_step on a built model, without data,
        checkpoints or metrics; under PP the real run's schedule (parallel/pipeline.py), its
        send/recv recorded."""

        def __init__(self, config, layout, model_args):  # not super().__init__: it builds data and checkpoints
            from torchtitan.components.lr_scheduler import build_lr_schedulers
            from torchtitan.components.optimizer import build_optimizers
            from torchtitan.distributed import utils as dist_utils

            from titan_fold.torchtitan_adapter import maybe_enable_amp, trainer_names

            self.job_config, self.parallel_dims, self.model_args = config, layout, model_args
            self.device = torch.device("cpu")
            self._names = trainer_names(self)
            self.guard = _VerdictFreeGuard(config.training.nonfinite, self.device)
            self.model_parts, _, _, self.pp_schedule = build_rank(config, layout, model_args)
            for part in self.model_parts:
                part.to_empty(device="cpu")
                _init_weights(part, config, model_args)
                part.train()
            self.pp_has_first_stage = self.model_parts[0].embeds_tokens
            self.pp_has_last_stage = self.model_parts[-1].output is not None
            self.loss_fn = _loss_fn(config)
            self.optimizers = build_optimizers(self.model_parts, config.optimizer, layout)
            self.optimizers.register_step_pre_hook(self.guard.before_optimizer_step)
            self.lr_schedulers = build_lr_schedulers(self.optimizers, config.lr_scheduler, config.training.steps)
            self.gradient_accumulation_steps = 1
            self.step, self.ntokens_seen = 1, 0
            tp_loss = layout.tp > 1 and not config.parallelism.disable_loss_parallel
            self.train_context = dist_utils.get_train_context(tp_loss)
            self.maybe_enable_amp = maybe_enable_amp(layout, config.training.mixed_precision_param, "cpu")
            self.checkpointer = self.metrics_processor = self

        def maybe_wait_for_staging(self):
            pass

        def should_log(self, step):
            return True

        def log(self, *args, **kwargs):
            pass

    return StepTrainer


def _init_weights(part: nn.Module, config, model_args) -> None:
    """The model's init_weights, on each parameter's local shard where values cannot change a
    collective: dropless routing (the fake dispatcher splits rows evenly whatever the router
    says) and untied embeddings (init_weights ties them again). Each shard gets the init's
    own distribution, without a DTensor dispatch per op: the CPU time of a step's recording."""
    from torch.nn.utils.stateless import _reparametrize_module

    by_shard = config.moe.capacity_factor is None and not model_args.tie_embeddings
    local = {name: local_tensor(p) for name, p in part.named_parameters()} if by_shard else {}
    with _reparametrize_module(part, local), torch.no_grad():
        part.init_weights(buffer_device=torch.device("cpu"))


def _StepTrainer(config, layout, model_args):
    return _step_trainer_class()(config, layout, model_args)


def _loss_fn(config):
    from torchtitan.components.loss import build_cross_entropy_loss

    return build_cross_entropy_loss(config)


# ---------------------------------------------------------------- matching


def first_divergence(per_group: dict) -> dict | None:
    """The first call at which the members of a group disagree (kind, dtype, shape, count),
    or the first send without its recv (the n-th send from a to b against the n-th recv on
    b from a: dtype and shape)."""
    for (desc, ranks), by_rank in per_group.items():
        if desc == P2P:
            div = _p2p_divergence(ranks, by_rank)
            if div is not None:
                return div
            continue
        members = [r for r in ranks if r in by_rank]
        missing = [r for r in ranks if r not in by_rank]
        seqs = {r: by_rank[r] for r in members}
        if not members:
            continue
        ref_rank = members[0]
        longest = max(len(s) for s in seqs.values())
        for i in range(longest):
            sigs = {r: _signature(seqs[r][i]) if i < len(seqs[r]) else None for r in members}
            if len(set(sigs.values())) > 1:
                ref = sigs[ref_rank]
                odd = next(r for r in members if sigs[r] != ref)
                def show(r, seq=seqs, i=i):
                    c = seq[r][i] if i < len(seq[r]) else None
                    return "nothing (sequence ended)" if c is None else f"{c['op']} {c['shapes']} at {c['site']}"
                return {"group": desc, "ranks": list(ranks), "call": i, "rank": odd, "reference_rank": ref_rank,
                        "rank_issued": show(odd), "reference_issued": show(ref_rank),
                        "unrecorded_members": missing}
    return None


def _p2p_divergence(pair: tuple[int, int], by_rank: dict) -> dict | None:
    def show(c):
        return "nothing (sequence ended)" if c is None else f"{c['op']} {c['shapes']} at {c['site']}"

    if any(r not in by_rank for r in pair):
        return None  # one of them not simulated (record_collectives' ranks)
    for src, dst in (pair, pair[::-1]):
        sends = [c for c in by_rank.get(src, []) if c["op"] == "send" and c["peer"] == dst]
        recvs = [c for c in by_rank.get(dst, []) if c["op"] == "recv" and c["peer"] == src]
        for i in range(max(len(sends), len(recvs))):
            send = sends[i] if i < len(sends) else None
            recv = recvs[i] if i < len(recvs) else None
            if send is None or recv is None or _p2p_signature(send) != _p2p_signature(recv):
                return {"group": f"{P2P} {src}->{dst}", "ranks": [src, dst], "call": i, "rank": src,
                        "reference_rank": dst, "rank_issued": show(send), "reference_issued": show(recv),
                        "unrecorded_members": []}
    return None


# ---------------------------------------------------------------- the whole dry run


def check_config(job_config, world_size: int) -> tuple[Layout, object, list[str]]:
    """The checks of a real run's preflight; a tokenizer folder missing on this machine is
    a warning (it lives on the cluster), every other failure is the real run's error."""
    from titan_fold.train import check_layout, model_args_from_config, preflight

    warnings = []
    try:
        layout = preflight(job_config, world_size)
    except FileNotFoundError as e:
        layout = check_layout(job_config, world_size)
        warnings.append(f"not checked here: {e}")
    _, model_args = model_args_from_config(job_config)
    model_args.update_from_config(job_config)
    return layout, model_args, warnings


def step_config(job_config, layout: Layout) -> tuple[object, str | None]:
    """The config whose training step the collective check records, and why it is not the
    job's own: op-level selective AC that this torch cannot run at this layout (a real run
    refuses it in preflight) is replaced by full AC, which issues the forward's collectives
    again in backward."""
    problem = op_sac_problem(job_config, layout)
    if problem is None:
        return job_config, None
    config = copy.deepcopy(job_config)
    config.activation_checkpoint.mode = "full"
    return config, problem


def dry_run(job_config, world_size: int, ranks: list[int] | None = None, collectives: bool = True) -> dict:
    """The report of a dry run (see the module docstring); ranks None = comm.dry_run_rank."""
    t0 = time.process_time()
    layout, model_args, warnings = check_config(job_config, world_size)
    if ranks is None:
        choice = job_config.comm.dry_run_rank
        if not -1 <= choice < world_size:
            raise UserError(f"comm.dry_run_rank = {choice}: must be a rank in [0, {world_size}) or -1 (every position)")
        ranks = positions(layout) if choice == -1 else [choice]
    est, info = cost_model_estimate(job_config, layout, model_args)
    report = {
        "config": job_config.job.config_file,
        "model": f"{job_config.model.name}/{job_config.model.flavor}",
        "world_size": world_size,
        "attention_mesh": layout.degrees("attention"),
        "expert_mesh": layout.degrees("expert"),
        "experts_per_rank": model_args.moe.num_experts // layout.ep,
        "warnings": warnings,
        "cost_model": {k: v for k, v in dataclasses.asdict(est).items()},
        "ranks": [],
    }
    if job_config.compile.enable:
        warnings.append("compile.enable: the dry run builds and measures the eager model")
    for r in ranks:
        rep = simulate_rank(job_config, world_size, r, model_args)
        rep["compare"] = compare(rep, est, info, layout)
        report["ranks"].append(rep)
    if collectives:
        t1 = time.process_time()
        step, problem = step_config(job_config, layout)
        if problem:
            warnings.append(f"{problem}; the collective step below runs with activation_checkpoint.mode = 'full'")
        col = report["collectives"] = {
            "note": "a shrunk model (same layout, experts, top-k and heads; tiny widths, "
                    f"{shrunk_config(job_config, model_args)[1].n_layers} layers) on all {world_size} ranks"
                    + ("; pipeline send/recv matched per pair of ranks" if layout.pp > 1 else ""),
            "step_failed": None, "first_divergence": None}
        try:
            per_group = record_collectives(step, world_size, model_args)
        except StepFailed as e:
            col["step_failed"] = e.report
        else:
            col.update(groups=len(per_group), calls=sum(len(c) for g in per_group.values() for c in g.values()),
                       by_kind=_count_kinds(per_group), first_divergence=first_divergence(per_group))
        col["cpu_seconds"] = round(time.process_time() - t1, 2)
    if dist.is_initialized():
        dist.destroy_process_group()
    report["cpu_seconds"] = round(time.process_time() - t0, 2)
    return report


def _count_kinds(per_group: dict) -> dict:
    """Calls per group name and op on one member of each group (the first recorded)."""
    out: dict[str, int] = defaultdict(int)
    for (desc, _), by_rank in per_group.items():
        calls = next(iter(by_rank.values()))
        for c in calls:
            out[f"{desc or 'group'}: {c['op']}"] += 1
    return dict(sorted(out.items()))


def _gib(b: float) -> str:
    return f"{b / GIB:8.2f}"


def format_report(report: dict) -> str:
    att = " x ".join(f"{k} {v}" for k, v in report["attention_mesh"].items())
    exp = " x ".join(f"{k} {v}" for k, v in report["expert_mesh"].items())
    lines = [f"dry run: {report['model']} on {report['world_size']} ranks ({os.path.basename(report['config'])})",
             f"  attention mesh: {att}", f"  expert mesh:    {exp}; {report['experts_per_rank']} experts per rank"]
    lines += [f"  warning: {w}" for w in report["warnings"]]
    for rep in report["ranks"]:
        c = rep["coordinates"]
        lines.append("")
        lines.append(f"rank {rep['rank']}: attention " + " ".join(f"{k}={v}" for k, v in c["attention"].items())
                     + " | expert " + " ".join(f"{k}={v}" for k, v in c["expert"].items()))
        for s in rep["stages"]:
            lines.append(f"  stage {s['index']} of {s['of']}: {s['modules']}")
        lines.append(f"  {'parameters by kind':<22} {'local numel':>14}  local shapes")
        for kind, k in sorted(rep["kinds"].items()):
            shapes = ", ".join(f"{n} {'x'.join(map(str, sh))}" for n, sh in list(k["shapes"].items())[:4])
            more = len(k["shapes"]) - 4
            lines.append(f"  {kind:<22} {k['numel']:>14,}  {shapes}{f' (+{more})' if more > 0 else ''}")
        acts = rep.get("activations", {})
        lines.append(f"  {'memory (GiB)':<22} {'dry run':>8} {'cost model':>11} {'diff':>7}")
        for row in rep["compare"]:
            lines.append(f"  {row['what']:<22} {_gib(row['dry_run'])} {_gib(row['cost_model']):>11} "
                         f"{100 * row['diff']:>+6.0f}%")
        if "per_microbatch" in acts:
            lines.append(f"  activations: {acts['source']}, {acts['per_microbatch'] / GIB:.2f} GiB per micro-batch; "
                         f"peak of forward + backward {acts['peak'] / GIB:.2f} GiB")
        else:
            lines.append(f"  activations: {acts.get('source', 'not measured')}")
        for row in rep["compare"]:
            if row["note"]:
                lines.append(f"  note on {row['what']} ({100 * row['diff']:+.0f}%): {row['note']}")
        lines.append(f"  ({rep['cpu_seconds']:.1f} CPU s)")
    col = report.get("collectives")
    if col and col["step_failed"]:
        f = col["step_failed"]
        lines += ["", f"collectives of one step: {col['note']}",
                  f"  THE STEP FAILS on rank {f['rank']}: {f['error']} at {f['site']} (raised in {f['innermost']})"]
    elif col:
        lines.append("")
        lines.append(f"collectives of one step: {col['calls']} calls in {col['groups']} process groups; {col['note']}")
        div = col["first_divergence"]
        if div is None:
            lines.append("  every member of every group issues the same sequence")
        else:
            lines.append(f"  MISMATCH in group {div['group']} {div['ranks'][:8]}{'...' if len(div['ranks']) > 8 else ''}, "
                         f"call {div['call']}: rank {div['rank']} issues {div['rank_issued']}; "
                         f"rank {div['reference_rank']} issues {div['reference_issued']}")
    lines.append(f"({report['cpu_seconds']:.1f} CPU s in all)")
    return "\n".join(lines)


def main(job_config) -> int:
    """`--comm.mode fake_backend`: the dry run of this job at NGPU ranks."""
    if job_config.comm.mode == "local_tensor":
        raise UserError("comm.mode = 'local_tensor': not supported, FSDP2 fails under torch's LocalTensorMode "
                        "(docs/planning.md, 'Dry run'); use comm.mode = 'fake_backend'")
    ngpu = os.environ.get("NGPU")
    if ngpu is None or not ngpu.isdigit() or int(ngpu) < 1:
        raise UserError(f"comm.mode = 'fake_backend' needs NGPU=<world size> in the environment (got {ngpu!r})")
    report = dry_run(job_config, int(ngpu), collectives=job_config.comm.dry_run_collectives)
    print(format_report(report), flush=True)
    path = job_config.comm.dry_run_json or os.path.join(job_config.job.dump_folder, "dry_run.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {path}", flush=True)
    col = report.get("collectives", {})
    return 1 if col.get("first_divergence") or col.get("step_failed") else 0


# ---------------------------------------------------------------- the banner of a real run


def _human(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / 2**20:.2f} MiB"


def memory_line(model_parts: list[nn.Module], job_config) -> str:
    b = parameter_report(model_parts, job_config)["bytes"]
    return (f"params {_human(b['params'])}, grads {_human(b['grads'])}, "
            f"optimizer {_human(b['optimizer'])} ({job_config.optimizer.name})")


def banner(layout: Layout, model_args, model_parts: list[nn.Module], job_config, num_stages: int = 1) -> str:
    """What a real run prints once at start (rank 0): both meshes, experts per rank,
    pipeline stages and this rank's parameter/gradient/optimizer memory, as the dry run counts it."""
    att = " x ".join(f"{k} {v}" for k, v in layout.degrees("attention").items())
    exp = " x ".join(f"{k} {v}" for k, v in layout.degrees("expert").items())
    return "\n".join([
        f"titan_fold: {job_config.model.name}/{job_config.model.flavor} on {layout.world_size} ranks",
        f"  attention mesh (pp, dp_replicate, dp_shard, cp, tp): {att}",
        (f"  expert mesh (pp, edp, ep, etp): {exp}; {model_args.moe.num_experts // layout.ep} of "
         f"{model_args.moe.num_experts} experts per rank"),
        f"  pipeline stages: {num_stages} ({len(model_parts)} on this rank)",
        f"  memory per rank (rank 0): {memory_line(model_parts, job_config)}",
    ])


# ---------------------------------------------------------------- the README excerpt

README_COMMAND = ("NGPU=64 python -m titan_fold.train --job.config_file qwen2.toml --comm.mode fake_backend "
                  "--comm.no-dry_run_collectives")
README_BEGIN = "<!-- dry-run excerpt: written by `python -m titan_fold.dryrun --update-readme`, checked by tests/test_dryrun.py -->"
README_END = "<!-- end of dry-run excerpt -->"


def readme_excerpt() -> str:
    """The README's example: qwen2.toml at 64 ranks, rank 0; the CPU time lines (they vary)
    left out."""
    from titan_fold.config import parse_args

    config = parse_args(["--job.config_file", "qwen2.toml", "--comm.mode", "fake_backend"])
    report = dry_run(config, 64, collectives=False)
    lines = [line for line in format_report(report).splitlines() if "CPU s" not in line]
    return "\n".join(lines)


def readme_block(excerpt: str) -> str:
    return f"{README_BEGIN}\n\n    $ {README_COMMAND}\n" + "".join(
        f"    {line}\n" if line else "\n" for line in excerpt.splitlines()) + f"\n{README_END}"


def update_readme(path: str) -> None:
    with open(path) as f:
        text = f.read()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    with open(path, "w") as f:
        f.write(text[:start] + readme_block(readme_excerpt()) + text[end:])


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--update-readme"]:
        sys.exit("usage: python -m titan_fold.dryrun --update-readme  (the dry run itself: "
                 "NGPU=N python -m titan_fold.train --job.config_file FILE --comm.mode fake_backend)")
    update_readme(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md"))
