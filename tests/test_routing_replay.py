"""Routing replay (moe.routing_replay, moe/replay.py) on one rank, fp32.

- Replaying the router's own choice gives exactly `off`'s logits, gradients and statistics.
- Replaying other experts: one MoE layer against a float64 reference written without the layer's
  code (combine weights = the scores at the replayed ids, normalised and scaled), its statistics
  counted on the replayed ids, its router still given a gradient.
- Activation checkpointing's recompute replays the same ids: gradients equal those without it.
- R2: a forward replaying a recording equals the recording even after an optimizer step moved the
  router's own choice.
- The trainer splits a batch's ids exactly as it splits its tokens, for every cp and tp rank, with
  and without packed documents.
"""

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import DIM, expert_ffn, make_layer
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from titan_fold.models import FLAVORS, Transformer
from titan_fold.moe import MoEArgs
from titan_fold.moe.replay import record_routing, replay_routing

B, S = 2, 16

ROUTERS = {
    "softmax_aux_loss": dict(load_balance="aux_loss", z_loss_coeff=1e-3),
    "sigmoid_norm_scaled_aux_free": dict(
        score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, load_balance="aux_free"
    ),
    "groups_drop_and_pad": dict(num_groups=4, group_topk=2, token_drop="drop_and_pad", capacity_factor=1.0),
}


def _model(**moe_fields) -> Transformer:
    args = FLAVORS["qwen2_moe"]["debug"]
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, **moe_fields))
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for i, moe in enumerate(m for m in model.modules() if hasattr(m, "router")):
            moe.router.gate.weight.normal_(0, 0.5)  # decided routing, not near-ties
            moe.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, moe.args.num_experts) * (i + 1))
    return model


def _run(model, tokens, labels, **kwargs):
    """-> (logits, {name: grad}, [(load, tokens_per_expert) per MoE layer]); stats reset first."""
    moes = [m for m in model.modules() if hasattr(m, "router")]
    for moe in moes:
        moe.load.zero_()
        moe.tokens_per_expert.zero_()
    model.zero_grad()
    logits = model(tokens, **kwargs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, [(m.load.clone(), m.tokens_per_expert.clone()) for m in moes]


def _random_ids(n_layers: int, num_experts: int, k: int, seed: int = 1) -> torch.Tensor:
    """[B, S, n_layers, k] distinct ids per token and layer."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(B, S, n_layers, num_experts, generator=gen).argsort(-1)[..., :k]


@pytest.mark.parametrize("router", ROUTERS)
def test_replaying_the_routers_choice_equals_off(router):
    model = _model(**ROUTERS[router])
    tokens = torch.randint(0, model.args.vocab_size, (B, S))
    labels = torch.randint(0, model.args.vocab_size, (B, S))
    with record_routing(model, tokens) as recording:
        model(tokens)
    assert recording.recorded is not None
    own = replay_routing(recording.recorded, tokens)  # [B, S, 4, k]
    assert own.shape == (B, S, model.args.n_moe_layers(), model.args.moe.top_k)
    # each layer its own column: the recorded layers differ
    assert not torch.equal(own[:, :, 0], own[:, :, 1])
    off = _run(model, tokens, labels)
    replayed = _run(model, tokens, labels, routed_experts=own)
    assert torch.equal(off[0], replayed[0])
    assert off[1].keys() == replayed[1].keys()
    for name in off[1]:
        assert torch.equal(off[1][name], replayed[1][name]), name
    for (load_a, tpe_a), (load_b, tpe_b) in zip(off[2], replayed[2], strict=True):
        assert torch.equal(load_a, load_b) and torch.equal(tpe_a, tpe_b)
    changed = sum(m.replay_changed for m in model.modules() if hasattr(m, "replay_changed"))
    assert changed[0].item() == 0 and changed[1].item() == B * S * model.args.n_moe_layers()


@pytest.mark.parametrize("router", list(ROUTERS)[:2])
def test_replayed_layer_against_float64_reference(router):
    """One MoE layer replaying random ids: y_t = sum_j p_j * ffn_{e_j}(x_t) with p the scores at
    the replayed ids (normalised, scaled; the aux-free bias never in them), the load counted on the
    replayed ids, the changed share against the router's own top-k."""
    args = MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=12, **ROUTERS[router])
    moe = make_layer(args, torch.float64)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(B, S, DIM, dtype=torch.float64, requires_grad=True)
    ids = _random_ids(1, 8, 2)[:, :, 0]  # [B, S, k]
    ids[0, :3] = -1  # padding: no replayed routing, the router's own choice, not counted
    y = moe(x, routed_experts=ids)
    gate, w13, w2 = moe.router.gate.weight.detach(), moe.experts.w13.detach(), moe.experts.w2.detach()
    tokens, flat = x.detach().reshape(-1, DIM), ids.reshape(-1, 2).clone()
    changed = 0
    for t in range(B * S):
        logits = gate @ tokens[t]
        scores = logits.softmax(-1) if args.score_func == "softmax" else logits.sigmoid()
        choice = scores + moe.router.expert_bias.double() if args.load_balance == "aux_free" else scores
        if flat[t, 0] < 0:
            flat[t] = choice.topk(2).indices
        else:
            changed += set(choice.topk(2).indices.tolist()) != set(flat[t].tolist())
        p = [scores[e] for e in flat[t].tolist()]
        if args.norm_topk_prob:
            p = [v / sum(p) for v in p]
        p = [v * args.routed_scaling_factor for v in p]
        want = sum(
            expert_ffn(tokens[t], w13, w2, e, v, args.prob_before_w2) for e, v in zip(flat[t].tolist(), p, strict=True)
        )
        assert moe.shared_expert is None
        torch.testing.assert_close(y.reshape(-1, DIM)[t], want, rtol=1e-10, atol=1e-12)
    assert torch.equal(moe.load, torch.bincount(flat.flatten(), minlength=8).double())
    assert moe.replay_changed.tolist() == [changed, B * S - 3] and changed > 0
    y.square().sum().backward()
    assert moe.router.gate.weight.grad is not None and moe.router.gate.weight.grad.abs().sum() > 0


def test_recompute_replays_the_same_experts():
    """Blocks checkpointed (static shapes: drop and pad) against the same model without: equal
    gradients with replayed ids that are not the router's choice."""
    model = _model(**ROUTERS["groups_drop_and_pad"])
    tokens = torch.randint(0, model.args.vocab_size, (B, S))
    labels = torch.randint(0, model.args.vocab_size, (B, S))
    ids = _random_ids(model.args.n_moe_layers(), model.args.moe.num_experts, model.args.moe.top_k)
    plain = _run(model, tokens, labels, routed_experts=ids)
    assert not torch.equal(plain[0], _run(model, tokens, labels)[0])  # the ids change the routing
    for layer_id, block in list(model.layers.named_children()):
        model.layers.register_module(layer_id, checkpoint_wrapper(block, preserve_rng_state=False))
    recomputed = _run(model, tokens, labels, routed_experts=ids)
    torch.testing.assert_close(recomputed[0], plain[0], rtol=0, atol=0)
    got = {name.replace("_checkpoint_wrapped_module.", ""): g for name, g in recomputed[1].items()}
    assert got.keys() == plain[1].keys()
    for name, grad in plain[1].items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_recorded_routing_survives_an_optimizer_step():
    """R2: record, step the optimizer (the router's own choice moves), replay: the training forward
    routes as recorded, which is not what the new weights would choose."""
    model = _model()
    tokens = torch.randint(0, model.args.vocab_size, (B, S))
    labels = torch.randint(0, model.args.vocab_size, (B, S))
    with record_routing(model, tokens) as recording:
        model(tokens)
    assert recording.recorded is not None
    recorded = replay_routing(recording.recorded, tokens)
    with torch.no_grad():  # the optimizer step: a large change of every router
        for moe in (m for m in model.modules() if hasattr(m, "router")):
            moe.router.gate.weight.add_(torch.randn_like(moe.router.gate.weight))
    with record_routing(model, tokens) as moved:
        model(tokens)
    assert moved.recorded is not None and not torch.equal(moved.recorded.routed_experts, recorded)
    moes = [m for m in model.modules() if hasattr(m, "router")]
    seen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda mod, args, kwargs, out: seen.append(kwargs["routed_experts"]), with_kwargs=True)
        for m in moes
    ]
    _, _, loads = _run(model, tokens, labels, routed_experts=replay_routing(recording.recorded, tokens))
    for h in hooks:
        h.remove()
    for i, (moe, ids, (load, _)) in enumerate(zip(moes, seen, loads, strict=True)):
        assert torch.equal(ids, recorded[:, :, i])
        assert torch.equal(load, torch.bincount(recorded[:, :, i].flatten(), minlength=moe.args.num_experts).float())
    assert sum(m.replay_changed[0] for m in moes) > 0
    with pytest.raises(ValueError, match="recorded on other tokens"):
        replay_routing(recording.recorded, torch.roll(tokens, 1, dims=1))


def test_recorded_step_with_mtp_routes_its_layers_by_their_routers():
    """The trainer's R2 micro-batch (TrainStep._forward_backward: the record pass, then the
    training forward) on a model with two MTP layers equals `off`'s: gradients, the MTP loss, every
    MoE layer's load counted once (the record pass runs neither the MTP layers nor their statistics);
    the record covers the main MoE layers, each replayed routing counted in replay_changed."""
    import copy

    from helpers import one_rank_step

    from titan_fold.models.mtp import IGNORE_INDEX, mtp_stats_values

    def lm_loss(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    args = FLAVORS["deepseek_v3"]["debug"]  # layer 0 dense, 1-3 MoE; the MTP layers' blocks MoE
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, load_balance="none"), mtp_layers=2)
    off = _sharp_router_model(args)
    recorded = copy.deepcopy(off)
    # the trainer's choice (its model_args)
    recorded.args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, routing_replay="recorded"))
    tokens = torch.randint(0, args.vocab_size, (B, S + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    runs = []
    for model in (off, recorded):
        one_rank_step(model, lm_loss).forward_backward(
            input_dict={"input": inputs}, labels=labels, global_valid_tokens=torch.tensor(float(B * S))
        )
        moes = [m for m in model.modules() if hasattr(m, "router")]
        runs.append(
            (
                {n: p.grad for n, p in model.named_parameters()},
                mtp_stats_values(model),
                [m.load.clone() for m in moes],
                sum(m.replay_changed for m in moes),
            )
        )
    (grads, mtp, loads, _), (replayed_grads, replayed_mtp, replayed_loads, changed) = runs
    assert len(loads) == args.n_moe_layers() + 2
    for name, grad in grads.items():
        torch.testing.assert_close(replayed_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert mtp is not None and mtp[1].item() == 1 and torch.equal(replayed_mtp, mtp)
    for load, replayed_load in zip(loads, replayed_loads, strict=True):
        assert load.sum().item() == B * S * args.moe.top_k and torch.equal(replayed_load, load)
    assert changed.tolist() == [0, B * S * args.n_moe_layers()]


class _Mesh:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "packed_documents"])
def test_the_trainer_splits_the_ids_as_the_tokens(documents):
    """TrainStep.post_dataloading_process on every (cp, tp) rank of cp2 x tp2: each id the MoE
    layers receive is the one of the token at its place (ids made from the tokens themselves)."""
    from titan_fold.parallel.cp_documents import cp_order
    from titan_fold.trainer.step import CP_ORDER, TrainStep

    cp, tp, s = 2, 2, 64
    args = dataclasses.replace(FLAVORS["qwen2_moe"]["debug"], mtp_layers=0)
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, routing_replay="rollout"))
    L, k = args.n_moe_layers(), args.moe.top_k
    tokens = torch.randperm(B * s).view(B, s)
    # each token's ids encode the token: layer l, choice j -> token * 100 + 10 * l + j
    routed = tokens[:, :, None, None] * 100 + 10 * torch.arange(L)[:, None] + torch.arange(k)
    batch = {"input": tokens, "routed_experts": routed}
    if documents:
        document_ids = torch.cat([torch.zeros(B, 40, dtype=torch.int64), torch.ones(B, s - 40, dtype=torch.int64)], 1)
        batch.update(document_ids=document_ids, **{CP_ORDER: cp_order(document_ids, cp)})
    for cp_rank, tp_rank in itertools.product(range(cp), range(tp)):
        layout = SimpleNamespace(
            cp=cp, tp=tp, attention={"cp": _Mesh(cp, cp_rank), "tp": _Mesh(tp, tp_rank)}, dp_cp_enabled=True
        )
        step = SimpleNamespace(parallel_dims=layout, model_args=args)
        step._routed_experts = lambda d, step=step: TrainStep._routed_experts(step, d)
        step.loss_target = lambda d, labels: labels  # the language-model loss's target
        inputs, _, extra_inputs, extra_kwargs = TrainStep.post_dataloading_process(step, dict(batch), tokens.clone())
        assert "routed_experts" not in extra_inputs
        mine = inputs.chunk(tp, dim=1)[tp_rank]  # the tokens this rank's MoE layers hold (SP)
        got = extra_kwargs["routed_experts"]
        assert got.shape == (B, s // (cp * tp), L, k)
        want = mine[:, :, None, None] * 100 + 10 * torch.arange(L)[:, None] + torch.arange(k)
        assert torch.equal(got, want), (cp_rank, tp_rank)


def test_rollout_replay_refuses_a_batch_without_ids():
    from titan_fold.common.errors import UserError
    from titan_fold.trainer.step import TrainStep

    args = FLAVORS["qwen2_moe"]["debug"]
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, routing_replay="rollout"))
    step = SimpleNamespace(model_args=args)
    tokens = torch.zeros(B, S, dtype=torch.int64)
    with pytest.raises(UserError, match="this batch has no routed_experts"):
        TrainStep._routed_experts(step, {"input": tokens})
    with pytest.raises(UserError, match=r"\(batch, tokens, MoE layers, top_k\)"):
        TrainStep._routed_experts(step, {"input": tokens, "routed_experts": torch.zeros(B, S, 3, 2, dtype=torch.int64)})


# ---------------------------------------------------------------- foldings against one rank

WORLD = 4
ROWS, SEQ = 4, 32  # the global batch: every case's dp ranks share its rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class Folding:
    """A layout of the 4 ranks (dp = 4 / (tp * cp) takes the rest) and the options on top."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    documents: bool = False  # packed documents, dealt over cp in blocks (cp_documents.py)
    stages: int = 1  # the model cut into pipeline stages, run back to back on each rank
    checkpoint: bool = False  # every block recomputed in backward
    copies: int = 0  # moe.hot_expert_replicas

    def __str__(self) -> str:
        dims = [f"{n}{v}" for n, v in (("tp", self.tp), ("cp", self.cp), ("ep", self.ep), ("etp", self.etp)) if v > 1]
        dims.insert(0, f"dp{WORLD // (self.tp * self.cp)}")
        extra = ["documents"] * self.documents + [f"{self.stages}stages"] * (self.stages > 1)
        return "_".join(dims + extra + ["ac"] * self.checkpoint + [f"copies{self.copies}"] * bool(self.copies))


FOLDINGS = [
    Folding(ep=2),
    Folding(ep=2, etp=2),
    Folding(tp=2, ep=2),
    Folding(cp=2, ep=2, documents=True),
    Folding(ep=2, stages=2),
    Folding(ep=2, etp=2, checkpoint=True),
    Folding(ep=4, copies=2),
]


def _folding_args(copies: int):
    args = FLAVORS["qwen2_moe"]["debug"]
    # balance losses are means over a micro-batch's tokens, which the trainer weighs per rank: off
    # here (their replayed statistics: the one-rank tests)
    moe = dataclasses.replace(args.moe, load_balance="none", hot_expert_replicas=copies)
    return dataclasses.replace(args, moe=moe, n_layers=4)


def _stage_parts(model, n: int):
    if n == 1:
        return [model]
    import copy

    first, last = model, copy.deepcopy(model)
    first.norm, first.output = None, None
    for i in ("2", "3"):
        del first.layers[i]
    last.tok_embeddings, last.embeds_tokens = None, False
    for i in ("0", "1"):
        del last.layers[i]
    return [first, last]


def _sharp_router_model(args):
    """The model of args, seed 0, its routers' weights drawn wide (N(0, 0.5)) so that the
    experts' scores are far apart: a change of routing shows in the outputs."""
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for moe in (m for m in model.modules() if hasattr(m, "router")):
            moe.router.gate.weight.normal_(0, 0.5)
    return model


def _reference(args, batch):
    ref = _sharp_router_model(args)
    kwargs = {k: batch[k] for k in ("document_ids", "routed_experts") if k in batch}
    logits = ref(batch["input"], **kwargs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
    loss = loss / batch["labels"].numel()
    loss.backward()
    return ref, loss.item(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _run_folding(folding: Folding, ref, ref_loss, ref_grads, batch, report):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    from titan_fold.common.tensors import model_fqn
    from titan_fold.parallel.attention import apply_cp, apply_tp
    from titan_fold.parallel.experts import apply_moe
    from titan_fold.parallel.mesh import Layout
    from titan_fold.parallel.placement import placement_plan
    from titan_fold.trainer.step import CP_ORDER, TrainStep

    args = ref.args
    layout = Layout(WORLD, tp=folding.tp, cp=folding.cp, ep=folding.ep, etp=folding.etp)
    layout.build_mesh("cpu")
    plan = placement_plan(args, layout)
    with torch.device("meta"):
        parts = _stage_parts(Transformer(args), folding.stages)
    for model in parts:
        if folding.tp > 1:
            apply_tp(model, layout.attention["tp"], loss_parallel=False)
        if folding.cp > 1:
            apply_cp(model, layout.attention["cp"])
        apply_moe(model, layout, plan)
        if folding.checkpoint:
            for layer_id, block in list(model.layers.named_children()):
                model.layers.register_module(layer_id, checkpoint_wrapper(block, preserve_rng_state=False))
        model.to_empty(device="cpu")
        model.init_weights()
        full_state = ref.state_dict()
        with torch.no_grad():
            for name, p in model.named_parameters():
                full = full_state[model_fqn(name)]
                if isinstance(p, DTensor):
                    p.to_local().copy_(
                        distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                    )
                else:
                    p.copy_(full)
    # this rank's rows of the global batch, then the trainer's own split of tokens and ids
    dp = WORLD // (folding.tp * folding.cp)
    dp_mesh = layout.get_optional_mesh("dp_shard")
    rows = slice(None) if dp_mesh is None else slice(dp_mesh.get_local_rank() * ROWS // dp, None)
    rows = slice(rows.start, None if rows.start is None else rows.start + ROWS // dp)
    input_dict = {k: batch[k][rows] for k in ("input", "routed_experts", "document_ids") if k in batch}
    if folding.documents:
        from titan_fold.parallel.cp_documents import cp_order

        input_dict[CP_ORDER] = cp_order(input_dict["document_ids"], folding.cp)
    step = SimpleNamespace(
        parallel_dims=layout,
        model_args=dataclasses.replace(args, moe=dataclasses.replace(args.moe, routing_replay="rollout")),
    )
    step._routed_experts = lambda d: TrainStep._routed_experts(step, d)
    step.loss_target = lambda d, labels: labels  # the language-model loss's target
    inputs, labels, _, kwargs = TrainStep.post_dataloading_process(step, input_dict, batch["labels"][rows])
    h = inputs
    for model in parts:
        h = model(h, **kwargs)
    loss = (
        torch.nn.functional.cross_entropy(h.flatten(0, 1), labels.flatten(), reduction="sum") / batch["labels"].numel()
    )
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    report("loss", abs(total.item() / folding.tp - ref_loss) / abs(ref_loss), 1e-5)
    named = {model_fqn(n): p for model in parts for n, p in model.named_parameters()}
    assert sorted(named) == sorted(ref_grads)
    for name, p in named.items():
        grad = p.grad
        copies = 1
        if isinstance(grad, DTensor):
            copies = grad.device_mesh.size()
            grad = grad.full_tensor()
        grad = grad.detach().clone()
        dist.all_reduce(grad)  # every rank's tokens; a DTensor's full gradient on each of its mesh's ranks
        err = ((grad / copies - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30)).item()
        report(("router " if "router.gate" in name else "grad ") + name, err, 1e-5)


def _folding_worker(rank: int, port: int, out_dir: str):
    import json
    import os

    from launcher import start_rank

    start_rank(rank, port, WORLD)
    results = []
    for documents in (False, True):
        args = _folding_args(0)
        gen = torch.Generator().manual_seed(7)
        batch = {
            "input": torch.randint(0, args.vocab_size, (ROWS, SEQ), generator=gen),
            "labels": torch.randint(0, args.vocab_size, (ROWS, SEQ), generator=gen),
        }
        L, E, k = args.n_moe_layers(), args.moe.num_experts, args.moe.top_k
        batch["routed_experts"] = torch.rand(ROWS, SEQ, L, E, generator=gen).argsort(-1)[..., :k]
        if documents:
            cuts = torch.tensor([5, 20, 23])  # four documents per row, the second one long
            batch["document_ids"] = (torch.arange(SEQ)[None, :, None] >= cuts).sum(-1).expand(ROWS, -1).clone()
        for folding in [f for f in FOLDINGS if f.documents == documents]:
            ref, ref_loss, ref_grads = _reference(_folding_args(folding.copies), batch)

            def report(what, err, tol, case=str(folding)):
                results.append((case, what, err, tol))

            _run_folding(folding, ref, ref_loss, ref_grads, batch, report)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    import torch.distributed as dist

    dist.destroy_process_group()


@pytest.mark.slow
def test_every_folding_replays_as_one_rank(tmp_path):
    """dp x ep, ep x etp, tp (SP), cp over packed documents, two pipeline stages, activation
    checkpointing and hot-expert copies, one 4-rank launch: the loss and every gradient of the
    one-rank model replaying the same (random) ids, fp32."""
    import json

    from launcher import run_ranks

    run_ranks(_folding_worker, WORLD, tmp_path)
    bad, cases = [], set()
    for r in range(WORLD):
        for case, what, err, tol in json.load(open(tmp_path / f"{r}.json")):
            cases.add(case)
            if not err <= tol:
                bad.append(f"rank {r} {case} {what}: {err:.3g} > {tol}")
    assert cases == {str(f) for f in FOLDINGS}
    assert not bad, "\n".join(bad[:30])


@pytest.mark.slow
def test_replaying_layer_compiles_whole():
    """An MoE layer replaying ids compiles into one graph (fullgraph) with the eager result, and new
    ids of the same shape need no recompile."""
    args = MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=12, **ROUTERS["groups_drop_and_pad"])
    moe = make_layer(args, torch.float32)
    x = torch.randn(B, S, DIM)
    torch._dynamo.reset()
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    for seed in (1, 2):
        ids = _random_ids(1, 8, 2, seed)[:, :, 0]
        with torch._dynamo.config.patch(error_on_recompile=seed > 1):
            got = compiled(x, routed_experts=ids)
        torch.testing.assert_close(got, moe(x, routed_experts=ids), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_recorded_replay_trains_as_off(tmp_path, seed_checkpoint):
    """The trainer's R2 step (a no-grad record pass, then the training forward replaying it), on one
    rank and through a 2-stage pipeline: the losses of `off` on one rank, and the metric says no
    routing changed."""
    from helpers import train_from_seed

    batch = ("--training.local_batch_size", "2", "--training.global_batch_size", "2")
    pp2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1")
    runs = {
        name: train_from_seed(tmp_path / name, nproc, seed_checkpoint, 2, *batch, "--moe.routing_replay", mode, *extra)
        for name, nproc, mode, extra in (
            ("off", 1, "off", ()),
            ("recorded", 1, "recorded", ()),
            ("recorded_pp2", 2, "recorded", pp2),  # the record pass through the pipeline schedule
        )
    }
    for name in ("recorded", "recorded_pp2"):
        for off, recorded in zip(runs["off"], runs[name], strict=True):
            assert recorded["loss"] == pytest.approx(off["loss"], rel=1e-5), name
            assert recorded["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-4), name
            assert off["routing_replay_changed"] is None and recorded["routing_replay_changed"] == 0.0, name


@pytest.mark.slow
@pytest.mark.parametrize("data", ["text", "rollouts_without_ids"])
def test_rollout_replay_without_rollout_data_refused_by_both_runs(tmp_path, data):
    """The real run and the dry run refuse `rollout` on data without routed_experts (text, or
    rollout records that carry none), in the same one line, before any work."""
    import json

    from helpers import forked

    from titan_fold.data.dataloader import ROLLOUTS_EXAMPLE

    common = ["--job.config_file", "debug_moe.toml", "--job.dump_folder", str(tmp_path), "--moe.routing_replay"]
    common.append("rollout")
    want = "error: moe.routing_replay = 'rollout' with training.dataset_format = 'text'"
    if data == "rollouts_without_ids":
        path = tmp_path / "rollouts.jsonl"
        with open(ROLLOUTS_EXAMPLE) as f, open(path, "w") as out:
            for line in f:
                record = json.loads(line)
                del record["routed_experts"]
                out.write(json.dumps(record) + "\n")
        common += ["--training.dataset", "hf", "--training.dataset_path", str(path)]
        common += ["--training.dataset_format", "rollouts", "--training.seq_len", "256"]
        want = f"error: moe.routing_replay = 'rollout' with training.dataset_path = '{path}': its records carry no"
    codes, _, real = forked(1, "titan_fold.train", *common)
    (dry_code,), _, dry = forked(0, "titan_fold.train", *common, "--comm.mode", "fake_backend", env={"NGPU": "2"})
    lines = [[line for line in err.splitlines() if line.startswith("error: ")] for err in (real, dry)]
    assert codes == [2] and dry_code == 2, (codes, dry_code)
    assert lines[0] == lines[1] and len(lines[0]) == 1 and lines[0][0].startswith(want), lines
