"""One 8-rank gloo launch: TP/SP, CP and TP x CP give the one-rank model's loss and gradients.

Every rank builds the single-rank reference model itself (same seed, fp32), then for each
(flavor, layout) builds the model on the meta device, applies apply_tp / apply_cp, runs
to_empty + init_weights, copies the reference weights in (each rank slicing its DTensor
shards) and compares the loss and every parameter gradient. Experts stay plain tensors
(no EP here): the MoE runs on this rank's tokens with the single-rank dispatcher, and in
dropless mode without balance losses it is per-token, hence layout independent; expert
gradients are then partial sums over the ranks holding different tokens (tp under SP, cp).
"""

import copy
import dataclasses
import json
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launcher import run_ranks, start_rank

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

WORLD = 8
B, S = 2, 32
RTOL = 1e-5


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """The rest of the 8 ranks (WORLD / (tp * cp)) are dp-like replicas fed the same batch."""

    tp: int
    cp: int
    sequence_parallel: bool = True
    loss_parallel: bool = False
    # FSDP2 over dp_shard x cp on top (as parallelize does), whose summed gradients are then
    # dp_shard x the one-rank ones
    fsdp: bool = False
    # 2: the model cut into two pipeline stages (run back to back here) that hand each other
    # plain tensors
    stages: int = 1

    def __str__(self) -> str:
        name = f"tp{self.tp} cp{self.cp} sp={self.sequence_parallel} loss_parallel={self.loss_parallel}"
        return name + (" fsdp" if self.fsdp else "") + (" 2 stages" if self.stages > 1 else "")


CASES = [
    Case(tp=2, cp=1, loss_parallel=True),
    Case(tp=4, cp=1),
    Case(tp=2, cp=1, sequence_parallel=False),
    Case(tp=1, cp=2),
    Case(tp=1, cp=4),
    Case(tp=2, cp=2, loss_parallel=True),
    Case(tp=2, cp=2, loss_parallel=True, fsdp=True),
    Case(tp=2, cp=2, loss_parallel=True, stages=2),
]


def _flavors():
    from titan_fold.models import FLAVORS

    out = {}
    for name in ("qwen2_moe", "mixtral"):
        args = FLAVORS[name]["debug"]
        # balance losses are means over a rank's tokens (layout dependent): off here
        moe = dataclasses.replace(args.moe, load_balance="none")
        # mixtral with one dense first layer: the dense FFN path too
        # 8 query / 4 kv heads: GQA that tp4 can still split
        out[name] = dataclasses.replace(
            args,
            moe=moe,
            first_k_dense=1 if name == "mixtral" else 0,
            n_layers=2,
            n_heads=8,
            n_kv_heads=4,
            head_dim=None,
        )
    # GPT-OSS: sinks sharded with the heads, a sliding layer (window 8 < S) and a full one,
    # biases on q, k, v, o and the experts
    args = FLAVORS["gpt_oss"]["debug"]
    out["gpt_oss"] = dataclasses.replace(
        args, moe=dataclasses.replace(args.moe, load_balance="none"), n_layers=2, layer_types=args.layer_types[:2]
    )
    return out


def _loss(logits, labels):
    # sum over tokens / global token count, as the trainer does
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum") / (B * S)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _fully_shard(model, layout):
    from torch.distributed.fsdp import fully_shard

    mesh = layout.get_optional_mesh("dp_shard_cp")
    units = [*model.layers.values(), model]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=unit is not model)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _stages(model, n: int):
    # pipeline cut at the block boundary: stage 0 keeps the embedding and layer 0
    if n == 1:
        return [model]
    first, last = model, copy.deepcopy(model)
    first.norm, first.output = None, None
    del first.layers["1"]
    last.tok_embeddings, last.embeds_tokens = None, False  # as parallel/pipeline.py cuts a later stage
    del last.layers["0"]
    return [first, last]


def _run_case(args, ref, tokens, labels, case: Case, report):
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from titan_fold.models import Transformer
    from titan_fold.parallel.attention import apply_cp, apply_tp, cp_shard
    from titan_fold.parallel.mesh import Layout
    from titan_fold.parallel.placement import placement_plan

    tp, cp, sp, lp, fsdp = case.tp, case.cp, case.sequence_parallel, case.loss_parallel, case.fsdp
    layout = Layout(WORLD, tp=tp, cp=cp)
    layout.build_mesh("cpu")
    tp_mesh, cp_mesh = layout.attention["tp"], layout.attention["cp"]
    with torch.device("meta"):
        parts = _stages(Transformer(args), case.stages)
    for model in parts:
        if tp > 1:
            apply_tp(model, tp_mesh, loss_parallel=lp, sequence_parallel=sp)
        if cp > 1:
            apply_cp(model, cp_mesh)
        model.to_empty(device="cpu")
        model.init_weights()
    named = [(n, p) for model in parts for n, p in model.named_parameters()]
    assert sorted(n for n, _ in named) == sorted(ref.grads)

    plan = placement_plan(args, layout)
    for name, p in named:
        if isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements):
            # init_weights on a meta-built model gave every tp rank the same replicated weights
            total = p.to_local().detach().clone()
            dist.all_reduce(total, group=tp_mesh.get_group())
            report(f"init replicated {name}", _rel(total / tp, p.to_local().detach()), 1e-6)
        if sp and name in plan and plan[name].mesh == "attention":
            # the applied layout is the plan's
            placed = plan[name]
            got = tuple(p.placements) if isinstance(p, DTensor) else ()
            assert got == placed.placements, (name, got, placed.placements)
            assert tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape) == placed.local_shape(layout), name
        full = ref.state_dict()[name]
        with torch.no_grad():
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full)

    if fsdp:
        for model in parts:
            _fully_shard(model, layout)
        named = [(n, p) for model in parts for n, p in model.named_parameters()]  # FSDP's own parameters

    positions = None
    if cp > 1:
        tokens, labels, positions = cp_shard(tokens, labels, cp_mesh)
    h = tokens
    for i, model in enumerate(parts):
        if i > 0:
            # what a pipeline stage can send: this rank's plain [b, s/(cp*tp), dim] shard
            assert type(h) is torch.Tensor and h.shape[1] == S // (cp * tp if sp else cp), (type(h), h.shape)
        h = model(h, positions)
    logits = h
    if lp:
        assert isinstance(logits, DTensor) and logits.placements[0].dim in (-1, 2), logits.placements
        with loss_parallel():
            loss = _loss(logits, labels)
            loss.backward()
        loss = loss.full_tensor()
    else:
        loss = _loss(logits, labels)
        loss.backward()
    total = loss.detach().double().clone()
    if cp > 1:
        dist.all_reduce(total, group=cp_mesh.get_group())
    ref_loss = ref.loss
    report("loss", abs(total.item() - ref_loss) / abs(ref_loss), RTOL)

    for name, p in named:
        ref_grad = ref.grads[name]
        g = p.grad
        assert g is not None, name
        if fsdp:
            # FSDP2 reduce-scattered over dp_shard x cp and left the tp placements as planned
            assert tuple(g.placements[1:]) == tuple(p.placements[1:]), (name, g.placements, p.placements)
            full = g.full_tensor()
            if ".experts." in name and tp > 1:  # plain expert tensors: partial over tp too
                dist.all_reduce(full, group=tp_mesh.get_group())
            ref_grad = ref_grad * layout.dp_shard
        elif isinstance(g, DTensor):
            # reduced over tp already: Replicate gradients must not be left Partial
            assert tuple(g.placements) == tuple(p.placements), (name, g.placements, p.placements)
            local = g.to_local().clone()
            if cp > 1:
                dist.all_reduce(local, group=cp_mesh.get_group())
            if all(isinstance(q, Replicate) for q in g.placements):
                full = local  # router, gates, norms: each tp rank's own copy must be right
            else:
                full = DTensor.from_local(local, g.device_mesh, g.placements).full_tensor()
        else:
            full = g.clone()
            # ranks holding different tokens: tp under sequence parallel, cp
            if tp > 1 and sp:
                dist.all_reduce(full, group=tp_mesh.get_group())
            if cp > 1:
                dist.all_reduce(full, group=cp_mesh.get_group())
        kind = "router" if "router.gate" in name else ("expert" if ".experts." in name else "grad")
        report(f"{kind} {name}", _rel(full, ref_grad), RTOL)


def _worker(rank: int, port: int, out_dir: str):
    start_rank(rank, port, WORLD)
    from titan_fold.models import Transformer

    results = []
    t0 = time.time()
    for flavor, args in _flavors().items():
        torch.manual_seed(0)
        ref = Transformer(args)
        ref.init_weights()
        tokens = torch.randint(0, args.vocab_size, (B, S))
        labels = torch.randint(0, args.vocab_size, (B, S))
        loss = _loss(ref(tokens), labels)
        loss.backward()
        ref.loss = loss.item()
        ref.grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        for c in CASES:
            case = f"{flavor} {c}"

            def report(what, err, tol, case=case):
                results.append((case, what, err, tol))

            t = time.time()
            try:
                _run_case(args, ref, tokens, labels, c, report)
            except Exception as e:  # keep the other ranks' collectives in step: report, stop
                results.append((case, f"exception {type(e).__name__}: {e}", float("inf"), 0.0))
                raise
            report("seconds", time.time() - t, float("inf"))
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"results": results, "seconds": time.time() - t0}, f)
    dist.destroy_process_group()


def test_attention_parallel_matches_one_rank():
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_worker, WORLD, tmp)
        per_rank = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(WORLD)]
    bad, worst = [], {}
    for r, data in enumerate(per_rank):
        for case, what, err, tol in data["results"]:
            key = (case, what.split()[0])
            worst[key] = max(worst.get(key, 0.0), err)
            if not err <= tol:
                bad.append(f"rank {r} {case} {what}: {err:.3g} > {tol}")
    for (case, kind), err in sorted(worst.items()):
        print(f"{case:46s} {kind:8s} " + (f"{err:.1f} s" if kind == "seconds" else f"max rel err {err:.2e}"))
    print(f"cases ran in {max(d['seconds'] for d in per_rank):.1f} s per rank")
    # every case checked the router gradient (MoE layers in both flavors)
    assert {c for c, k in worst if k == "router"} == {c for c, _ in worst}
    assert not bad, "\n".join(bad[:30])


def test_sequence_positions_of_the_cp_tp_ranks():
    from titan_fold.parallel.attention import sequence_positions

    # 8 tokens, cp 2 x tp 2: cp rank 0 holds chunks 0 and 3 ([0, 1], [6, 7]), cp rank 1 chunks
    # 1 and 2; sequence parallelism gives each tp rank one contiguous half of that
    assert sequence_positions(2, 2, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert sequence_positions(1, 4, 3).tolist() == list(range(12))  # tp alone: contiguous
    assert sorted(sequence_positions(4, 2, 4).tolist()) == list(range(32))
