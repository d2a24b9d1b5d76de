"""One simulated rank measured: its parameters, the activations of a fake-tensor step, the cost model beside them."""

import contextlib
import copy
import time
import traceback
import weakref

import torch
import torch.nn as nn
from torchtitan.protocols.train_spec import get_train_spec

from titan_fold.common.tensors import local
from titan_fold.compat.dispatch import FakeTensorMode, TorchDispatchMode, storage_key, tree_leaves
from titan_fold.dryrun.fake_counts import use_fake_counts
from titan_fold.dryrun.world import coordinates, init_fake_world
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.pipeline import check_pipeline, format_stages, pipeline
from titan_fold.planning import cost_model
from titan_fold.planning.accounting import GIB, bytes_of, parameter_report
from titan_fold.planning.options import RECOMPUTE
from titan_fold.planning.sizes import model_sizes
from titan_fold.trainer.preflight import layout_from_config
from titan_fold.trainer.train_spec import register_train_specs

DIFF_NOTE = 0.10  # differences beyond this fraction get an explanation


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
                st = local(t).untyped_storage()
                key = storage_key(st)
                if key not in self.sizes:
                    self.sizes[key] = st.nbytes()
                    self.live += self.sizes[key]
                    weakref.finalize(st, self._free, key)
        self.peak = max(self.peak, self.live)
        return out

    def bytes_of(self, tensors) -> int:
        keys = {storage_key(local(t).untyped_storage()) for t in tensors}
        return sum(self.sizes.get(k, 0) for k in keys)


def fake_step(model_parts: list[nn.Module], stages: list, layout: Layout, job_config, model_args) -> dict:
    """One micro-batch forward + backward of every stage of this rank under FakeTensorMode.

    -> {"per_microbatch": bytes kept for backward by all of this rank's stages,
        "peak": most bytes alive during forward + backward (activations, gathered parameters,
        gradients), "unsharded": gathered parameters still held after forward}.
    """
    from torch.distributed.tensor.parallel import loss_parallel

    tr = job_config.training
    mb = job_config.parallelism.pipeline_parallel_microbatch_size if layout.pp > 1 else tr.local_batch_size
    S = tr.seq_len // layout.cp
    compute_dtype = getattr(torch, tr.mixed_precision_param)
    kept = peak = unsharded = 0
    with FakeTensorMode(allow_non_fake_inputs=True):
        for part, _ in zip(model_parts, stages, strict=True):  # one stage per part
            part.to_empty(device="cpu")  # values do not matter: shapes only (no init_weights)
            first, last = part.embeds_tokens, part.output is not None
            if first:
                x = torch.zeros(mb, S, dtype=torch.int64)
            else:  # a later stage gets this rank's sequence shard of the hidden states
                x = torch.zeros(mb, S // layout.tp, model_args.dim, dtype=compute_dtype, requires_grad=True)
            positions = torch.arange(S) if layout.cp > 1 else None
            tracker = LiveBytes()
            lp = (
                loss_parallel()
                if last and layout.tp > 1 and not job_config.parallelism.disable_loss_parallel
                else contextlib.nullcontext()
            )
            with tracker, lp:
                out = part(x, positions=positions)
                if last:
                    labels = torch.zeros(mb, S, dtype=torch.int64)
                    loss = torch.nn.functional.cross_entropy(
                        out.flatten(0, 1).float(), labels.flatten(), reduction="sum"
                    )
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

    register_train_specs()
    spec = get_train_spec(job_config.model.name)
    with torch.device("meta"), _cast_default_dtype(dtype):
        model = spec.model_cls(model_args)
    if layout.pp > 1:
        _, all_fqns, _ = check_pipeline(job_config, model_args, layout.pp)
        schedule, parts, _, _ = pipeline(
            model,
            layout,
            job_config,
            torch.device("cpu"),
            model_args,
            spec.parallelize_fn,
            spec.build_loss_fn(job_config),
        )
        pp_rank = layout.get_mesh("pp").get_local_rank()
        stages = list(range(pp_rank, len(all_fqns), layout.pp))
    else:
        all_fqns = [["tok_embeddings", *(f"layers.{i}" for i in range(model_args.n_layers)), "norm", "output"]]
        parts, stages, schedule = [spec.parallelize_fn(model, layout, job_config)], [0], None
    use_fake_counts(parts)
    return parts, stages, all_fqns, schedule


def _dry_config(job_config):
    """The config the meta build runs with: compile off (a dry run compiles nothing)."""
    config = copy.deepcopy(job_config)
    config.compile.enable = False
    return config


def step_key(parts: list[nn.Module], stages: list) -> tuple:
    """What a rank's fake-tensor step depends on beyond the layout's degrees (its batch and
    sequence shard are every rank's): its stages and every parameter's local shape and dtype."""
    return tuple(stages), tuple(
        (name, tuple(local(p).shape), p.dtype) for part in parts for name, p in part.named_parameters()
    )


def simulate_rank(
    job_config,
    world_size: int,
    rank: int,
    model_args,
    measure: bool = True,
    progress=None,
    measured: dict | None = None,
) -> dict:
    """One rank built on the meta device and counted, and with `measure` its fake-tensor step.
    measured: step_key -> (rank, activations) of the ranks stepped so far in this dry run; a rank
    of the same key takes that rank's activations (one step per distinct rank, not per rank)."""

    t0 = time.process_time()
    init_fake_world(world_size, rank)
    layout = layout_from_config(job_config, world_size)
    layout.build_mesh("cpu")
    config = _dry_config(job_config)
    # built once, in the compute dtype the fake step needs: the counts do not depend on it
    compute = getattr(torch, job_config.training.mixed_precision_param)
    parts, stages, all_fqns, _ = build_rank(config, layout, model_args, compute if measure else torch.float32)
    if progress is not None:
        progress(f"rank {rank}: model built on the meta device")
    report = {
        "rank": rank,
        "coordinates": coordinates(layout),
        "stages": [
            {"index": s, "of": len(all_fqns), "modules": format_stages([all_fqns[s]], 1).split(": ", 1)[1]}
            for s in stages
        ],
        **parameter_report(parts, job_config),
    }
    if job_config.optimizer.name == "Muon":
        # each local element of a Muon parameter goes to its unit's owner and comes back (two
        # all-to-alls per mesh, parallel/orthogonalize.py), in optimizer.muon_ns_dtype
        n = report["muon_numel"]
        report["muon"] = {
            "numel": n,
            "momentum_bytes": n * bytes_of(job_config.training.dtype),
            "sent_bytes": 2 * n * bytes_of(job_config.optimizer.muon_ns_dtype),
        }
    report["moe_layers"] = sum(1 for part in parts for b in part.layers.values() if b.moe_enabled)
    report["dense_layers"] = sum(1 for part in parts for b in part.layers.values() if not b.moe_enabled)
    if measured is None:
        measured = {}  # this rank alone
    key = step_key(parts, stages) if measure else None
    if key is not None and key in measured:
        first, activations = measured[key]
        report["activations"] = {**activations, "as_rank": first}
    elif measure:
        try:
            report["activations"] = {
                "source": "fake-tensor step",
                **fake_step(parts, stages, layout, config, model_args),
            }
            if key is not None:
                measured[key] = (rank, report["activations"])
        except Exception as e:  # reported; the cost model's estimate stands in
            report["activations"] = {
                "source": "cost model estimate (the fake-tensor step failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0][:200]})"
            }
            report["activations"]["traceback"] = "".join(
                line for line in traceback.format_exc().splitlines(True) if "titan_fold" in line
            )
    report["cpu_seconds"] = round(time.process_time() - t0, 2)
    return report


# ---------------------------------------------------------------- the cost model beside it


def cost_model_estimate(job_config, layout: Layout, model_args) -> tuple[cost_model.Memory, dict]:
    tr, par = job_config.training, job_config.parallelism
    ac = job_config.activation_checkpoint
    mapping = cost_model.Mapping(
        layout.pp,
        layout.dp_replicate,
        layout.dp_shard,
        layout.cp,
        layout.tp,
        layout.ep,
        layout.etp,
        layout.edp,
        recompute=ac.mode if ac.mode in RECOMPUTE else "none",
    )
    micro = par.pipeline_parallel_microbatch_size if layout.pp > 1 else tr.local_batch_size
    work = cost_model.Workload(
        tr.seq_len,
        tr.global_batch_size if tr.global_batch_size > 0 else tr.local_batch_size * layout.dp,
        job_config.moe.capacity_factor,
        compute_bytes=bytes_of(tr.mixed_precision_param),
        micro_batch=micro,
        optimizer=job_config.optimizer.name,
        ns_steps=job_config.optimizer.muon_ns_steps,
    )
    sizes = model_sizes(model_args, tr.seq_len, f"{job_config.model.name}/{job_config.model.flavor}")
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
    layer_note = (
        f"this rank holds {layers} blocks, the cost model's busiest stage ceil(layers / pp) = {assumed}"
        f"{'' if len(rank_report['stages']) == 1 else ' (one stage per pp rank; here interleaved stages)'}"
    )
    rows = [
        ("params", b["params"], est.params, layer_note),
        ("grads", b["grads"], est.grads, layer_note),
        ("optimizer", b["optimizer"], est.optimizer, layer_note),
    ]
    if "per_microbatch" in acts:
        # 1F1B: pp rank p holds min(pp - p, micro-batches) forwards before its first backward
        pp_rank = rank_report["coordinates"]["attention"]["pp"]
        flight = min(layout.pp - pp_rank, info["pipeline_microbatches"])
        measured = acts["per_microbatch"] * flight
        why = []
        if flight != info["in_flight"]:
            why.append(
                f"{flight} micro-batch(es) in flight here (pipeline micro-batches of this config: "
                f"{info['pipeline_microbatches']}), the cost model assumes {info['in_flight']} "
                f"(global batch / dp sequences, one per micro-batch)"
            )
        per_mb = est.activations / info["in_flight"]
        why.append(
            f"per micro-batch {acts['per_microbatch'] / GIB:.2f} GiB measured against {per_mb / GIB:.2f} "
            "GiB estimated: the fake step measures what autograd and the activation checkpointing policy "
            "keep; the cost model counts an inventory of saved tensors per block (docs/planning.md), "
            "and for selective recompute two ffn-wide tensors per block where torchtitan's op policy "
            "recomputes every other matmul"
        )
        note = "; ".join(why)
        rows.append(
            (
                "activations",
                measured,
                est.activations
                + (est.logits if rank_report["stages"][-1]["index"] == rank_report["stages"][-1]["of"] - 1 else 0),
                note,
            )
        )
    out = []
    for what, mine, theirs, note in rows:
        diff = (mine - theirs) / theirs if theirs else 0.0
        out.append(
            {
                "what": what,
                "dry_run": mine,
                "cost_model": theirs,
                "diff": diff,
                "note": note if abs(diff) > DIFF_NOTE else "",
            }
        )
    return out
