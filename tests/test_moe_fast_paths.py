"""The MoE layer's fast paths: the fused router against the op-by-op router, no host sync inside
the dropless layer on one EP rank, the grouped-GEMM choice, and on an sm90 GPU with QuACK the
QuACK experts against float64 and a CUDA-graph-captured layer against the uncaptured one."""

import itertools
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from helpers import _grouped_product, _stand_in_quack, _stand_in_up_epilogue
from host_sync import HostSync, no_host_sync
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from titan_fold.moe import MoE, MoEArgs
from titan_fold.moe.quack import quack_problem, use_quack
from titan_fold.moe.router import Router, limit_to_groups, route, route_whole, top_k_indices

GPU_QUACK = quack_problem() is None


def reference_routing(router: Router, x: torch.Tensor, seq_len: int):
    """The router as separate ops (the definition route() fuses): probs, experts, loss, balance
    loss and tokens per expert of x [T, dim], one rank."""
    args = router.args
    E, k, T = args.num_experts, args.top_k, x.shape[0]
    logits = router.gate(x).float()
    scores = logits.softmax(-1) if args.score_func == "softmax" else logits.sigmoid()
    choice = scores + router.expert_bias if args.load_balance == "aux_free" else scores
    experts = choice.topk(k, dim=-1).indices
    probs = scores.gather(-1, experts)
    if args.norm_topk_prob:
        probs = probs / probs.sum(-1, keepdim=True)
    dist = scores if args.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)

    def balance(d, e):  # d [G, n, E], e [G, n, k]
        f = torch.stack([torch.bincount(row.flatten(), minlength=E) for row in e]).float() / (e.shape[1] * k)
        return E * (f * d.mean(1)).sum(-1)

    whole = balance(dist[None], experts[None])[0]
    loss = torch.zeros((), device=x.device)
    if args.load_balance == "aux_loss":
        loss = loss + args.aux_loss_coeff * whole
    elif args.load_balance == "seq_aux_loss":
        b = T // seq_len
        loss = loss + args.aux_loss_coeff * balance(dist.view(b, seq_len, E), experts.view(b, seq_len, k)).mean()
    if args.z_loss_coeff > 0:
        loss = loss + args.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    return probs, experts, loss, whole.detach(), torch.bincount(experts.flatten(), minlength=E).float()


ROUTERS = list(
    itertools.product(
        ["softmax", "sigmoid"], ["aux_loss", "seq_aux_loss", "aux_free", "none"], [False, True], [0.0, 1e-3]
    )
)


# on a GPU the router runs its Triton kernels (moe/router_triton.py): a few of the settings there
GPU_ROUTERS = [
    ("softmax", "aux_loss", True, 1e-3),
    ("sigmoid", "aux_free", True, 0.0),
    ("softmax", "seq_aux_loss", False, 0.0),
]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize(
    "device,score_func,load_balance,norm,z",
    [("cpu", *r) for r in ROUTERS] + [pytest.param("cuda", *r, marks=needs_cuda) for r in GPU_ROUTERS],
)
def test_fused_router_equals_op_by_op_router(device, score_func, load_balance, norm, z):
    """fp32: the same choices, weights, losses, statistics, and gradients of the gate."""
    args = MoEArgs(
        num_experts=16,
        top_k=4,
        score_func=score_func,
        load_balance=load_balance,
        norm_topk_prob=norm,
        z_loss_coeff=z,
        aux_loss_coeff=0.0 if load_balance in ("aux_free", "none") else 1e-2,
    )
    torch.manual_seed(0)
    router = Router(32, args).to(device)
    router.gate.weight.data.normal_(0, 0.3)
    router.expert_bias.normal_(0, 0.1)
    x = torch.randn(3 * 20, 32, device=device)
    got = router(x, 20)
    want = reference_routing(router, x, 20)
    torch.testing.assert_close(got.experts, want[1])
    for a, b in zip(
        (got.probs, got.loss, got.balance_loss, got.tokens_per_expert),
        (want[0], want[2], want[3], want[4]),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    imbalance = want[4].max() / want[4].mean()
    record = torch.stack([want[3], torch.zeros_like(imbalance), imbalance, torch.ones_like(imbalance)])
    torch.testing.assert_close(got.record, record, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(got.probs.shape, device=device)
    grad = torch.autograd.grad((got.probs * upstream).sum() + got.loss, router.gate.weight)[0]
    grad_ref = torch.autograd.grad((want[0] * upstream).sum() + want[2], router.gate.weight)[0]
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)


# MoEArgs fields beside num_experts = 12 or 16 and top_k = 3: each score function, balancing, the
# groups (three or four experts each), z loss, normalization and scaling, one choice
FUSED_ROUTES = [
    dict(score_func="softmax", load_balance="aux_loss", norm_topk_prob=True, z_loss_coeff=1e-2),
    dict(
        score_func="sigmoid",
        load_balance="aux_free",
        norm_topk_prob=True,
        num_groups=4,
        group_topk=2,
        routed_scaling_factor=2.5,
    ),
    dict(score_func="softmax", load_balance="seq_aux_loss"),
    dict(score_func="sigmoid", load_balance="seq_aux_loss", z_loss_coeff=1e-2, num_groups=2, group_topk=1),
    dict(score_func="sigmoid", load_balance="aux_loss", norm_topk_prob=True),
    dict(score_func="softmax", load_balance="none", z_loss_coeff=1e-1, top_k=1),
]


def assert_ties_decide(logits: torch.Tensor, args: MoEArgs, experts: torch.Tensor, case):
    """The tied logits [T, E] (no bias) decide the choice by the tie rule: route_whole on the experts
    mirrored (id e as E-1-e, group g as G-1-g), i.e. with the higher id first among equals, chooses
    other experts, and with groups keeps other groups."""
    E = args.num_experts
    mirrored = E - 1 - route_whole(logits.flip(-1), torch.zeros(E, device=logits.device), 20, args, 0.5)[1]
    assert not torch.equal(mirrored, experts), case
    if args.num_groups > 1:
        scores = logits.softmax(-1) if args.score_func == "softmax" else logits.sigmoid()
        kept = limit_to_groups(scores, args.num_groups, args.group_topk).isfinite()
        kept_mirrored = limit_to_groups(scores.flip(-1), args.num_groups, args.group_topk).isfinite().flip(-1)
        assert not torch.equal(kept, kept_mirrored), case


def fused_route_against_route_whole(device: str):
    """moe/router_triton.py's kernels against route_whole run op by op, float32, three sequences of
    20 tokens: the same experts, on drawn logits and on logits with many ties (the lower expert
    and group first; assert_ties_decide shows the ties decide the choice); the combine weights, losses and statistics, and the logits' gradient from
    the weights and from the losses (weighted up so their part shows), within float32 rounding."""
    from titan_fold.moe.router_triton import fused_route_whole

    for E, fields, tied in itertools.product((12, 16), FUSED_ROUTES, (False, True)):
        args = MoEArgs(**{"num_experts": E, "top_k": 3, "aux_loss_coeff": 0.1, **fields})
        gen = torch.Generator(device=device).manual_seed(E)
        drawn = torch.randn(60, E, device=device, generator=gen) * 2
        base = torch.randint(0, 3, (60, E), device=device, generator=gen).float() if tied else drawn
        bias = torch.zeros(E, device=device) if tied else torch.randn(E, device=device, generator=gen) * 0.1
        upstream = torch.randn(60, args.top_k, device=device, generator=gen)
        # the loss scale a tensor (MoE.aux_loss_scale) or a number; the losses' gradient none where
        # they have none (aux-free balancing without z loss)
        scale = torch.tensor(0.5, device=device) if tied else 0.5
        with_loss = args.load_balance in ("aux_loss", "seq_aux_loss") or args.z_loss_coeff > 0
        outs, grads = [], []
        for fn in (fused_route_whole, route_whole):
            logits = base.clone().requires_grad_()
            out = fn(logits, bias, 20, args, scale)
            total = (out[0] * upstream).sum() + (10 * out[2] if with_loss else 0)
            grads.append(torch.autograd.grad(total, logits)[0])
            outs.append(out)
        (got, want), case = outs, (E, fields, tied)
        assert torch.equal(got[1], want[1]), case
        if tied:
            assert_ties_decide(base, args, want[1], case)
        for a, b in zip((got[0], *got[2:], grads[0]), (want[0], *want[2:], grads[1]), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, case=case: f"{case}: {m}")


@pytest.mark.slow
def test_fused_route_equals_route_whole_in_the_triton_interpreter():
    """The Triton kernels' logic on the CPU: Triton's interpreter runs them (TRITON_INTERPRET=1, set
    before Triton is imported: a process of its own)."""
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
        "import test_moe_fast_paths as t; t.fused_route_against_route_whole('cpu')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]


@needs_cuda
def test_fused_route_equals_route_whole_on_the_gpu(monkeypatch):
    """The Triton kernels compiled for the GPU, and the router taking them in eager mode."""
    import titan_fold.moe.router as router_module

    fused_route_against_route_whole("cuda")
    calls, fused = [], router_module.fused_route_whole
    monkeypatch.setattr(router_module, "fused_route_whole", lambda *a: calls.append(1) or fused(*a))
    Router(32, MoEArgs(num_experts=16, top_k=4)).cuda()(torch.randn(40, 32, device="cuda"), 20)
    assert calls


@pytest.mark.parametrize("compiled", [False, True])
def test_top_k_indices_is_topk_the_lower_column_first_among_equals(compiled):
    """route's k argmax passes, eager and compiled as on a GPU (the token count dynamic): each row's
    k largest, largest first, as a stable descending sort's head, so among equal scores the lower
    column first; aten's topk where a row's scores are distinct; rows with -inf (the experts
    outside a token's groups) still get k finite ones."""
    torch.manual_seed(0)
    fn = torch.compile(top_k_indices) if compiled else top_k_indices
    distinct = torch.rand(300, 64).argsort(-1).float()  # each row a permutation of 0..63
    tied = torch.randint(0, 6, (300, 64)).float()
    grouped = distinct.masked_fill(distinct < 40, float("-inf"))  # 24 finite a row
    for scores in (distinct, tied, grouped):
        torch._dynamo.maybe_mark_dynamic(scores, 0)
        want = scores.sort(dim=-1, descending=True, stable=True).indices[:, :8]
        assert torch.equal(fn(scores, 8), want)
        assert torch.equal(fn(scores[:77], 8), want[:77])  # another token count, no recompile needed
    assert torch.equal(fn(distinct, 8), distinct.topk(8, -1).indices)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("compiled", [False, True])
def test_limit_to_groups_keeps_the_best_groups_the_lower_first_among_equals(device, compiled):
    """limit_to_groups, eager and compiled (the token count dynamic; compiled on the CPU each
    group's best two come from aten's topk, elsewhere from argmax passes): each token keeps the
    experts of the group_topk groups whose two best scores sum highest, the lower group first
    among equal sums, and -inf elsewhere, as a per-token loop over sorted lists written out here,
    on distinct scores and on scores with many ties."""
    torch.manual_seed(0)
    fn = torch.compile(limit_to_groups) if compiled else limit_to_groups
    G, n, kept = 8, 4, 3  # groups, experts a group, groups kept
    for scores in (torch.randn(120, G * n, dtype=torch.float64), torch.randint(0, 4, (120, G * n)).double()):
        x = scores.to(device)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        got = fn(x, G, kept).cpu()
        for t, row in enumerate(scores.tolist()):
            sums = [sum(sorted(row[g * n : (g + 1) * n])[-2:]) for g in range(G)]
            best = sorted(range(G), key=lambda g: -sums[g])[:kept]
            assert got[t].tolist() == [v if e // n in best else float("-inf") for e, v in enumerate(row)]


def test_route_is_one_graph():
    """route() and route_whole() trace whole (no graph break), so on a GPU each compiles into one or
    two kernels each way."""
    args = MoEArgs(num_experts=8, top_k=2, load_balance="seq_aux_loss", z_loss_coeff=1e-3)
    logits = torch.randn(40, 8, requires_grad=True)
    for fn, extra in ((route, (2, args)), (route_whole, (20, args, torch.tensor(0.5)))):
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        got, want = compiled(logits, torch.zeros(8), *extra), fn(logits, torch.zeros(8), *extra)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)


def _layer_step(args: MoEArgs, tensors: str):
    """Forward and backward of the layer, one EP rank: on fake tensors in bf16 (no data on the
    host to read), or on real fp32 tensors under no_host_sync() (tests/host_sync.py)."""
    if tensors == "real":
        moe = MoE(64, args)
        moe.init_weights(0.1)
        x = torch.randn(2, 16, 64, requires_grad=True)
        with no_host_sync():
            moe(x).square().sum().backward()
        return
    default = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            moe = MoE(64, args)
        finally:
            torch.set_default_dtype(default)
        x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
        moe(x).float().square().sum().backward()


@pytest.mark.parametrize("tensors", ["fake", "real"])
@pytest.mark.parametrize("load_balance", ["aux_loss", "seq_aux_loss", "aux_free"])
def test_dropless_layer_has_no_host_sync(load_balance, tensors):
    """A forward and backward of the dropless layer, one EP rank, on fake tensors (bf16 rows) and
    on real ones under the host-sync check: any .item(), .tolist(), bool() of a tensor or
    data-dependent shape inside the layer (router, dispatch, experts, combine, aux-loss
    bookkeeping) raises. Such a layer can be captured in a CUDA graph. (Over ep > 1 with
    moe.exchange = "static" or "device": tests/test_static_exchange.py.)"""
    _layer_step(
        MoEArgs(
            num_experts=8,
            top_k=2,
            moe_ffn_dim=32,
            shared_ffn_dim=32,
            load_balance=load_balance,
            z_loss_coeff=1e-3,
            aux_loss_coeff=1e-2 if load_balance != "aux_free" else 0.0,
        ),
        tensors,
    )


@pytest.mark.parametrize("tensors, error", [("fake", DataDependentOutputException), ("real", HostSync)])
def test_host_sync_check_fails_on_a_sync(tensors, error):
    """The check above can fail: token drop without padding cuts the dropped rows off, a size
    read from the device."""
    with pytest.raises(error):
        _layer_step(MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=32, token_drop="drop", capacity_factor=1.0), tensors)


def test_grouped_gemm_choice_on_cpu():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert not use_quack("auto", x, 32) and not use_quack("torch", x, 32)
    with pytest.raises(RuntimeError, match="moe.expert_kernels = 'quack' runs on CUDA tensors only"):
        use_quack("quack", x, 32)


def test_quack_check_leaves_no_graph_break(monkeypatch):
    """The machine check behind moe.expert_kernels = "auto" runs once, outside the traced graph: on a
    GPU it queries the device in a way dynamo cannot trace, and a break there split every compiled
    MoE layer (and kept its buffers' updates out of CUDA graphs)."""
    import titan_fold.moe.quack as quack_module

    calls = []

    def problem(device_index):
        calls.append(device_index)
        torch._dynamo.graph_break()  # stands for the device query: nothing eager, a break if traced
        return "not here"

    monkeypatch.setattr(quack_module, "_problem", problem)
    monkeypatch.setattr(quack_module, "_PROBLEMS", {})
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1 if quack_problem(0) is None else x - 1, backend="eager", fullgraph=True)
    assert torch.equal(f(torch.ones(2)), torch.zeros(2)) and calls == [0]
    torch._dynamo.reset()


def test_grouped_gemm_config_rule(monkeypatch):
    from titan_fold.common.config import ConfigError, parse_args
    from titan_fold.moe import quack
    from titan_fold.trainer.preflight import preflight

    # as on a machine without a GPU, where QuACK cannot run (a GPU machine checks the refusal too)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(quack, "_PROBLEMS", {})
    with pytest.raises(ConfigError, match="moe.expert_kernels = 'quack' needs"):
        preflight(parse_args(["--job.config_file", "debug_moe.toml", "--moe.expert_kernels", "quack"]), 1)


def test_quack_only_where_the_row_count_is_fixed():
    """QuACK tunes its kernels for every new row count: "quack" with a count that changes in every
    call (the exact exchange over ep > 1, token drop without padding) is refused before the run
    starts, naming the setting; the static exchange and padding to capacity fix the count, and so
    does one ep rank dropless. "auto" takes torch's GEMMs where the count varies."""
    from titan_fold.common.config import ConfigError, parse_args
    from titan_fold.moe.quack import varying_rows
    from titan_fold.parallel.experts import apply_moe
    from titan_fold.parallel.placement import EXPERT, Placed
    from titan_fold.trainer.preflight import preflight

    # a dry run's plan (fake backend): QuACK's machine check is left to the GPUs, the row rule is not
    base = ["--job.config_file", "debug_moe.toml", "--moe.expert_kernels", "quack", "--comm.mode", "fake_backend"]
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    with pytest.raises(
        ConfigError,
        match=r"^moe.expert_kernels = 'quack' with the exact exchange over "
        r"parallelism.expert_parallel_degree x expert_tensor_parallel_degree = 2 x 1",
    ):
        preflight(parse_args(base + ep2), 2)
    with pytest.raises(
        ConfigError,
        match=r"^moe.expert_kernels = 'quack' with moe.token_drop = 'drop' \(moe.capacity_factor = 1.0, unpadded\)",
    ):
        preflight(parse_args(base + ["--moe.capacity_factor", "1.0"]), 1)
    fixed = [
        (ep2 + ["--moe.exchange", "static"], 2),
        (ep2 + ["--moe.exchange", "device"], 2),
        (["--moe.capacity_factor", "1.0", "--moe.token_drop", "drop_and_pad"], 1),
        ([], 1),
    ]
    for extra, world in fixed:
        preflight(parse_args(base + extra), world)

    class _Layout:  # what apply_moe reads of a layout for a model without expert placements
        ep, etp, cp, tp = 2, 1, 1, 1

        def get_optional_mesh(self, name):
            return None

    for exchange, want in (("auto", "torch"), ("exact", "torch"), ("static", "auto"), ("device", "auto")):
        layer = MoE(64, MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=32, exchange=exchange))
        # every weight left where it is (no model-parallel dims): only the dispatchers and the GEMM choice change
        apply_moe(layer, _Layout(), {n: Placed(EXPERT, (), (), tuple(p.shape)) for n, p in layer.named_parameters()})
        assert layer.experts.grouped_gemm == want, (exchange, layer.experts.grouped_gemm)
    assert varying_rows(MoEArgs(), 1, 1) is None and varying_rows(MoEArgs(), 1, 2) is not None


@pytest.mark.parametrize("prob_before_w2", [True, False])
@pytest.mark.parametrize("gathered", [True, False])
def test_quack_experts_wiring_matches_float64(monkeypatch, gathered, prob_before_w2):
    """moe/quack.py's experts (forward, and backward through gemm_dgated and the w13 GEMMs) on a
    float64 stand-in for QuACK, on the CPU: the output and the gradients of the tokens, the
    probabilities, w13 and w2 equal float64 autograd of the per-expert loop (moe/experts.py's
    fallback), rows gathered from the tokens in place or given; one expert gets no row."""
    import titan_fold.moe.quack as qm
    from titan_fold.moe.dispatcher import _Dispatch, _sum_rows
    from titan_fold.moe.experts import _swiglu_loop

    calls = []
    monkeypatch.setattr(qm, "_PLANS", {})
    monkeypatch.setattr(qm, "_QUACK", _stand_in_quack(calls))
    monkeypatch.setattr(qm, "_UP_EPILOGUE", _stand_in_up_epilogue(calls))
    monkeypatch.setattr(qm, "_LOADED", True)
    torch.manual_seed(0)
    T, k, E, dim, ffn = 12, 2, 4, 16, 8
    experts_of = torch.randn(T, E - 1).topk(k, -1).indices.flatten()
    order = torch.sort(experts_of, stable=True).indices
    counts = torch.bincount(experts_of, minlength=E)
    rows, slot = order // k, torch.empty_like(order).scatter_(0, order, torch.arange(T * k))
    leaves = {
        n: torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        for n, shape in (("x", (T, dim)), ("p", (T * k,)), ("w13", (E, 2 * ffn, dim)), ("w2", (E, dim, ffn)))
    }
    gy = torch.randn(T * k, dim, dtype=torch.float64)

    def grads(run):
        for t in leaves.values():
            t.grad = None
        y = run(**leaves)
        y.backward(gy)
        return [y.detach()] + [leaves[n].grad.clone() for n in ("x", "p", "w13", "w2")]

    want = grads(
        lambda x, p, w13, w2: _swiglu_loop(
            _Dispatch.apply(x, rows, slot, k, False), counts, w13, w2, p[order].unsqueeze(-1), prob_before_w2
        )
    )

    def ours(x, p, w13, w2):
        offs = qm.offsets(counts)
        if gathered:
            return qm.quack_experts(x, offs, w13, w2, p[order], prob_before_w2, qm.Gather(rows, slot, k, _sum_rows))
        return qm.quack_experts(_Dispatch.apply(x, rows, slot, k, False), offs, w13, w2, p[order], prob_before_w2)

    for got, exp, name in zip(grads(ours), want, ("y", "dx", "dp", "dw13", "dw2"), strict=True):
        assert torch.allclose(got.double(), exp, rtol=1e-5, atol=1e-6), name
    # forward: w13 with the SwiGLU in its epilogue, w2; backward: the gated dgrad, w2's weight
    # gradient, w13's input and weight gradients
    kinds = [kind for kind, _ in calls]
    assert kinds[0] == "gated" and kinds.count("gated") == kinds.count("dgated") == 1
    # each plain GEMM's first call: tuned, then its config pinned
    assert kinds.count("tuned") == kinds.count("pinned") == 4 and len(calls) == 10
    # off sm90 GPUs QuACK's frontends tune the epilogue GEMMs (moe/quack.py's _tuned)
    assert all(config is None for kind, config in calls if kind in ("gated", "dgated"))


def test_quack_launch_tuned_once_per_signature_then_replayed(monkeypatch):
    """moe/quack.py's _gemm: the first call of a call signature (dtypes, shapes, strides) goes
    through QuACK's tuner and then launches the config chosen (here the tuner's pick: its stand-in
    times no configs), later calls of it replay that launch, whatever their values; a new shape is
    tuned again; an empty contraction writes zeros and an empty output is left alone, with no launch.
    A stand-in for QuACK's interface (_stand_in_quack) records each call and computes it in
    float64: each result must equal the grouped product computed apart."""
    import titan_fold.moe.quack as qm

    monkeypatch.setattr(qm, "_PLANS", {})
    calls = []
    q = _stand_in_quack(calls)
    torch.manual_seed(0)
    x, w = torch.randn(6, 8), torch.randn(3, 8, 4)
    for counts in ([4, 0, 6], [1, 7, 2]):  # one signature, two routings
        offs = qm.offsets(torch.tensor(counts))
        rows = torch.randint(0, 6, (10,), dtype=torch.int32)
        got = qm._varlen_m(q, x, w, offs, rows)
        assert torch.allclose(got.double(), _grouped_product(x, w, offs, None, rows))
    pinned_plan = calls[1][1]
    assert [kind for kind, _ in calls] == ["tuned", "pinned", "replay"] and calls[2][1] == pinned_plan
    assert pinned_plan[0] == "its pick"
    grad, right = torch.randn(10, 4), torch.randn(10, 8)
    dw = qm._wgrad(q, grad, right, offs)  # a new signature: tuned
    assert torch.allclose(dw.double(), _grouped_product(grad.mT, right, None, offs, None))
    assert [kind for kind, _ in calls] == ["tuned", "pinned", "replay", "tuned", "pinned"]
    empty_k = torch.full((3, 4, 8), float("nan"))
    qm._gemm(q, torch.randn(4, 0), torch.randn(0, 8), empty_k, cu_seqlens_k=torch.zeros(4, dtype=torch.int32))
    assert torch.equal(empty_k, torch.zeros(3, 4, 8)) and len(calls) == 5
    assert qm._varlen_m(q, x, w, qm.offsets(torch.zeros(3, dtype=torch.int64)), rows[:0]).shape == (0, 4)
    assert len(calls) == 5


def test_quack_config_chosen_from_the_sweeps_fastest_timed_in_turn(monkeypatch):
    """moe/quack.py's _choose: after the tuner's sweep, its _TOP fastest configs are timed again in
    _ROUNDS rounds, each timing every one in turn, and the least median wins: here the sweep ranked
    "a" first, the configs' own times rank "b" first, and the clock slows by 5% a timing, which the
    rounds spread over all four alike; the fifth ("e", faster still but last but one in the sweep) is
    not timed. A tuner that swept nothing now (a signature it had) gives its own pick, unretimed."""
    import titan_fold.moe.quack as qm

    class Config:
        def __init__(self, name):
            self.kwargs = {"config": name}

    own = {"a": 1.00, "b": 0.90, "c": 0.95, "d": 1.10, "e": 0.80, "f": 1.50}
    sweep = {"a": 0.70, "b": 0.75, "c": 0.80, "d": 0.85, "e": 0.90, "f": 0.95}

    timed = []

    class Tuner:  # QuACK's autotuner: fn is the launch it tunes
        def __call__(self, *args, **kwargs):
            assert args == ("operand",) and kwargs == {"k": 1}
            self.configs_timings = {Config(n): [t, t, t] for n, t in reversed(sweep.items())}
            self.best_config = Config("a")

        @staticmethod
        def fn(*args, config, **kwargs):
            assert args == ("operand",) and kwargs == {"k": 1}
            timed.append(config)

    monkeypatch.setattr(qm, "_time_ms", lambda fn: (fn(), own[timed[-1]] * (1 + 0.05 * len(timed)))[1])
    tuner = Tuner()
    assert qm._choose(tuner, ("operand",), {"k": 1}) == "b"
    assert timed == ["a", "b", "c", "d"] * qm._ROUNDS
    tuner.__class__.__call__ = lambda self, *args, **kwargs: None  # the signature seen: no sweep
    assert qm._choose(tuner, ("operand",), {"k": 1}) == "a" and len(timed) == 4 * qm._ROUNDS


def test_quack_up_projection_without_a_kernel(monkeypatch):
    """The up projection with its SwiGLU epilogue (moe/quack.py's _up_forward) launches nothing
    where there is nothing to compute: an empty contraction (dim 0) gives ab = 0 and h = 0 in every
    routed row, no routed rows give empty outputs."""
    import titan_fold.moe.quack as qm

    calls = []
    monkeypatch.setattr(qm, "_UP_EPILOGUE", _stand_in_up_epilogue(calls))
    monkeypatch.setattr(qm, "_LOADED", True)
    offs, rows, p = qm.offsets(torch.tensor([2, 0, 3])), torch.tensor([0, 1, 1, 3, 2], dtype=torch.int32), torch.rand(5)
    ab, h = qm._up_forward(torch.randn(4, 0), rows, offs, torch.randn(3, 8, 0), p)
    assert torch.equal(ab, torch.zeros(5, 8)) and torch.equal(h, torch.zeros(5, 4))
    ab, h = qm._up_forward(
        torch.randn(4, 6), rows[:0], qm.offsets(torch.zeros(3, dtype=torch.int64)), torch.randn(3, 8, 6), p[:0]
    )
    assert ab.shape == (0, 8) and h.shape == (0, 4) and not calls
    ab, h = qm._up_forward(torch.randn(4, 6), rows, offs, torch.randn(3, 8, 6), p)  # one launch: the GEMM's
    assert len(calls) == 1 and h.shape == (5, 4)


def test_quack_ops_run_directly_in_eager_and_as_ops_when_traced():
    """moe/quack.py's _op: eager code on plain tensors runs the implementation without the
    dispatcher (no titan_fold op reaches a dispatch mode); traced with fake tensors the call is
    the registered op, with the shapes of its fake."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_fold.moe.quack import _op

    @_op("test_scale_rows")
    def scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * s[:, None]

    @scale_rows.register_fake
    def _(x, s):
        return torch.empty_like(x)

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.name())
            return func(*args, **(kwargs or {}))

    x, s = torch.randn(3, 2), torch.randn(3)
    with Ops():
        got = scale_rows(x, s)
    assert torch.equal(got, x * s[:, None]) and seen and not any("titan_fold" in n for n in seen)
    graph = make_fx(scale_rows, tracing_mode="fake")(x, s).graph
    assert [str(n.target) for n in graph.nodes if n.op == "call_function"] == ["titan_fold.test_scale_rows.default"]


# ---- GPU (sm90+, quack-kernels installed) ------------------------------------------------------

needs_quack = pytest.mark.skipif(not GPU_QUACK, reason=f"needs QuACK: {quack_problem()}")


def _rel(got, want):
    return ((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm()).item()


def _experts_case(T, k, E, dim, ffn, prob_before_w2, idle_experts=0, seed=0):
    """Routed rows for GroupedExperts (experts_of sorted by expert; the last idle_experts get no row)
    and float64 per-expert GEMMs on them: -> (inputs, reference) with inputs the bf16 module, the
    float64 tokens, probabilities, counts, rows, slot and order, the output gradient, and reference
    the float64 output and gradients by name."""
    from titan_fold.moe.dispatcher import _Dispatch
    from titan_fold.moe.experts import GroupedExperts, _swiglu_loop

    torch.manual_seed(seed)
    experts_of = torch.randn(T, E - idle_experts).topk(k, -1).indices.flatten()
    order = torch.sort(experts_of, stable=True).indices
    counts = torch.bincount(experts_of, minlength=E)
    rows, slot = order // k, torch.empty_like(order).scatter_(0, order, torch.arange(T * k))
    x = torch.randn(T, dim, dtype=torch.float64)
    probs = torch.rand(T * k, dtype=torch.float64) / k
    mod = GroupedExperts(dim, ffn, E).cuda()
    mod.init_weights(0.02)
    w = {n: p.detach().double().cpu().requires_grad_() for n, p in mod.named_parameters()}
    xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
    want = _swiglu_loop(
        _Dispatch.apply(xr, rows, slot, k, False), counts, w["w13"], w["w2"], pr[order].unsqueeze(-1), prob_before_w2
    )
    gy = torch.randn_like(want)
    want.backward(gy)
    inputs = dict(
        mod=mod.to(torch.bfloat16),
        x=x,
        probs=probs,
        counts=counts.cuda(),
        rows=rows.cuda(),
        slot=slot.cuda(),
        order=order.cuda(),
        gy=gy.cuda().bfloat16(),
        k=k,
    )
    reference = {"y": want, "dx": xr.grad, "dp": pr.grad, **{f"d{n}": w[n].grad for n in w}}
    return inputs, reference


def _run_experts(case, grouped_gemm, rows_in, prob_before_w2):
    """GroupedExperts forward and backward on a case of _experts_case through grouped_gemm's GEMMs,
    the rows gathered in the layer (the dispatcher's, or QuACK's fused gather), given, or given with
    the weight gradients queued apart and flushed after backward -> the output and gradients by name."""
    from titan_fold.moe.dispatcher import _Dispatch, _sum_rows
    from titan_fold.moe.quack import Gather
    from titan_fold.moe.wgrad import WgradQueue

    mod, k = case["mod"], case["k"]
    mod.grouped_gemm = grouped_gemm
    mod.wgrad = WgradQueue() if rows_in == "given_split_wgrad" else None
    for p in mod.parameters():
        p.grad = None
    xg = case["x"].cuda().bfloat16().requires_grad_()
    pg = case["probs"].cuda().float().requires_grad_()
    probs = pg[case["order"]]
    if rows_in == "gathered" and grouped_gemm == "quack":
        y = mod(xg, case["counts"], probs, prob_before_w2, Gather(case["rows"], case["slot"], k, _sum_rows))
    elif rows_in == "gathered":
        y = mod(_Dispatch.apply(xg, case["rows"], case["slot"], k, False), case["counts"], probs, prob_before_w2)
    else:
        y = mod(xg[case["rows"]], case["counts"], probs, prob_before_w2)
    y.backward(case["gy"])
    if mod.wgrad is not None:
        assert all(getattr(mod, n).grad is None for n in ("w13", "w2")) and len(mod.wgrad) == 2
        mod.wgrad.flush()
    return {"y": y, "dx": xg.grad, "dp": pg.grad, **{f"d{n}": getattr(mod, n).grad for n in ("w13", "w2")}}


@needs_quack
@pytest.mark.parametrize("rows_in", ["gathered", "given", "given_split_wgrad"])
@pytest.mark.parametrize("prob_before_w2", [True, False])
def test_quack_experts_match_float64(rows_in, prob_before_w2):
    """Forward and every gradient (tokens, probabilities, w13, w2) of the QuACK experts, with
    the gather fused, on given rows, or on given rows with the weight gradients queued apart
    (moe.ep_overlap = "wgrad") and run after backward, against float64 per-expert GEMMs; two
    experts get no row."""
    E = 8
    case, want = _experts_case(300, 4, E, 256, 128, prob_before_w2, idle_experts=2)
    got = _run_experts(case, "quack", rows_in, prob_before_w2)
    for n in want:
        assert _rel(got[n], want[n]) < 1e-2, n
    for n in ("dw13", "dw2"):
        assert got[n][E - 2 :].abs().max() == 0  # experts without rows


@needs_quack
@pytest.mark.parametrize("prob_before_w2", [True, False])
def test_quack_experts_round_no_more_than_torch(prob_before_w2):
    """The QuACK experts (gather fused) and torch._grouped_mm's (rows gathered by the dispatcher),
    bf16, each against float64 at Qwen3-MoE-like proportions (top-8 of 64 experts, width 1024, expert
    width 384): the output and every gradient no further off through QuACK than through torch, so a
    difference between the two paths' loss curves does not come from one path rounding more."""
    case, want = _experts_case(2048, 8, 64, 1024, 384, prob_before_w2)
    err = {
        path: {n: _rel(g, want[n]) for n, g in _run_experts(case, path, "gathered", prob_before_w2).items()}
        for path in ("torch", "quack")
    }
    for n in want:
        assert err["torch"][n] < 1e-2 and err["quack"][n] <= 1.05 * err["torch"][n], (
            n,
            err["torch"][n],
            err["quack"][n],
        )


@needs_quack
def test_quack_weight_gradient_writes_zeros_for_experts_without_rows():
    """The varlen-K GEMM stores every expert's tile, zeros where the expert got no row, into
    memory poisoned with NaN."""
    from titan_fold.moe.quack import _gemm, offsets, quack

    counts = torch.tensor([5, 0, 7, 0, 4], device="cuda")
    left, right = (torch.randn(16, n, device="cuda", dtype=torch.bfloat16) for n in (64, 32))
    for _ in ("tuned", "replayed"):
        out = torch.full((5, 64, 32), float("nan"), device="cuda", dtype=torch.bfloat16)
        _gemm(quack(), left.mT, right, out, cu_seqlens_k=offsets(counts))
        assert out[1].abs().max() == 0 and out[3].abs().max() == 0
        want = left[:5].double().mT @ right[:5].double()
        assert _rel(out[0], want) < 1e-2


@needs_quack
def test_quack_replayed_launch_equals_tuned_launch(monkeypatch):
    """moe/quack.py's _gemm on the GPU: a replayed launch gives the bits of the tuned launch on the
    same inputs, and on another routing of the same shapes the grouped product within bf16's
    rounding of float64, for the two kinds of plain call the experts make (varlen-M with gathered
    rows, varlen-K)."""
    import titan_fold.moe.quack as qm

    monkeypatch.setattr(qm, "_PLANS", {})
    q, gen = qm.quack(), torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    T, k, E, dim, ffn = 64, 4, 8, 128, 64
    x, w, dy = randn(T, dim), randn(E, dim, ffn), randn(T * k, ffn)
    calls = {
        "varlen-M, gathered rows": lambda offs, rows: (qm._varlen_m(q, x, w, offs, rows), (x, w, offs, None, rows)),
        "varlen-K": lambda offs, rows: (
            qm._wgrad(q, dy, x[rows.long()], offs),
            (dy.mT, x[rows.long()], None, offs, None),
        ),
    }
    for name, call in calls.items():
        first = None
        for counts in ([T * k // E] * E, [0, 40, 3, 100, 0, 60, 53, 0]):  # even, then lopsided with idle experts
            offs = qm.offsets(torch.tensor(counts, device="cuda"))
            rows = torch.randint(0, T, (T * k,), device="cuda", dtype=torch.int32, generator=gen)
            got, operands = call(offs, rows)
            again, _ = call(offs, rows)
            assert torch.equal(got, again), name
            assert _rel(got, _grouped_product(*operands)) < 1e-2, name
            first = first or len(qm._PLANS)
        assert len(qm._PLANS) == first, name  # the second routing replayed the first's launch


@needs_quack
def test_quack_configs_chosen_once_per_signature_from_the_sweep(monkeypatch):
    """moe/quack.py on a GPU: the gathered up projection, the gated input gradient and a plain
    varlen-M GEMM each get their config once per call signature, one of the _TOP fastest of their
    tuner's sweep (QuACK's, over its configs for the GEMM; for the gathered up projection on sm90
    with each config's 1x1-cluster twin as well); each gives the bits QuACK's own tuning gives (the
    gated GEMM's row sum dp within float32 rounding: its tiles along N sum in another order) and is
    within bf16's rounding of the float64 product."""
    import titan_fold.moe.quack as qm

    for cache in ("_CONFIGS", "_PLANS"):
        monkeypatch.setattr(qm, cache, {})
    q, gen = qm.quack(), torch.Generator(device="cuda").manual_seed(0)
    T, k, E, dim, ffn = 256, 4, 8, 256, 128
    randn = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    x, w13, w2, dy = (
        randn(T, dim),
        randn(E, 2 * ffn, dim) * dim**-0.5,
        randn(E, dim, ffn) * ffn**-0.5,
        randn(T * k, dim),
    )
    rows = torch.randint(0, T, (T * k,), device="cuda", dtype=torch.int32, generator=gen)
    offs = qm.offsets(torch.tensor([100, 0, 300, 7, 129, 200, 64, 224], device="cuda"))
    p = torch.rand(T * k, device="cuda", generator=gen)
    cap = torch.cuda.get_device_capability()[0]

    def top(tuner):
        ranked = sorted(tuner.configs_timings.items(), key=lambda item: item[1][0])
        return [c.kwargs["config"] for c, _ in ranked[: qm._TOP]]

    ab, h = qm._up_forward(x, rows, offs, w13, p)
    up_tuner = qm._tuner(qm._up_launch, "gated", True, cap)
    up_top = top(up_tuner)
    dab, h2, dp = qm._dgated(q, dy, ab, p, offs, w2)
    dgated_top = top(qm._tuner(qm._dgated_launch, "gated", False, cap))
    out = qm._varlen_m(q, dab, w13, offs)
    plain_top = top(q.gemm_tuned)
    chosen = lambda launch, *args: qm._CONFIGS[(launch, *qm._signature(*args))]  # noqa: E731
    assert chosen(qm._up_launch, x, w13.mT, ab, h, offs, rows, p) in up_top
    assert chosen(qm._dgated_launch, dy, w2, ab, p, offs) in dgated_top
    assert qm._PLANS[qm._signature(dab, w13, out, offs, None, None)][0] in plain_top
    space = [c.kwargs["config"] for c in up_tuner.configs]
    assert all(c.cluster_n == 1 for c in space)
    assert cap != 9 or {replace(c, cluster_m=1) for c in space} <= set(space)
    again = qm._up_forward(x, rows, offs, w13, p)  # the signature's config, no new sweep
    assert len(qm._CONFIGS) == 2 and all(torch.equal(a, b) for a, b in zip(again, (ab, h), strict=True))
    ab_q, h_q = torch.empty_like(ab), torch.empty_like(h)
    qm._up_launch(x, w13.mT, ab_q, h_q, offs, rows, p)  # QuACK's frontends tune their own configs
    dab_q, h2_q, dp_q = qm._dgated_launch(dy, w2, ab, p, offs)
    out_q = torch.empty_like(out)
    q.gemm_tuned(dab, w13, out_q, None, cu_seqlens_m=offs, dynamic_scheduler=True)
    for got, want in ((ab, ab_q), (h, h_q), (dab, dab_q), (h2, h2_q), (out, out_q)):
        assert torch.equal(got, want)
    assert torch.allclose(dp, dp_q, rtol=1e-5, atol=1e-5)
    assert _rel(ab, _grouped_product(x, w13.mT, offs, None, rows)) < 1e-2
    gate, up = ab.float()[:, 0::2], ab.float()[:, 1::2]
    assert _rel(h, torch.nn.functional.silu(gate) * up * p[:, None]) < 1e-2
    assert _rel(out, _grouped_product(dab, w13, offs, None, None)) < 1e-2


def _qwen3_like(grouped_gemm):
    return MoEArgs(num_experts=16, top_k=4, moe_ffn_dim=128, norm_topk_prob=True, expert_kernels=grouped_gemm)


@needs_quack
@pytest.mark.parametrize("compiled", [False, True])
def test_quack_layer_matches_torch_layer(compiled):
    """The whole layer, bf16: QuACK against torch._grouped_mm (eager and compiled)."""
    outs = {}
    for choice in ("torch", "quack"):
        torch.manual_seed(0)
        moe = MoE(256, _qwen3_like(choice)).cuda()
        moe.init_weights(0.05)
        moe = moe.bfloat16()
        run = torch.compile(moe, fullgraph=False) if compiled else moe
        x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = run(x)
        y.float().square().sum().backward()
        outs[choice] = [y, x.grad] + [p.grad for p in moe.parameters()]
    for a, b in zip(outs["quack"], outs["torch"], strict=True):
        assert _rel(a, b) < 2e-2


@needs_quack
@pytest.mark.parametrize("grouped_gemm", ["torch", "quack"])
def test_cuda_graph_captured_layer_matches_uncaptured(grouped_gemm):
    """20 SGD steps of the dropless layer, forward and backward captured in one CUDA graph and
    replayed, against the same steps run eagerly: the same losses."""

    def train(capture: bool):
        torch.manual_seed(0)
        moe = MoE(256, replace(_qwen3_like(grouped_gemm), load_balance="aux_loss", shared_ffn_dim=128)).cuda()
        moe.init_weights(0.05)
        moe = moe.bfloat16()
        params = list(moe.parameters())
        data = [torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)] * 20  # one batch: the loss falls
        x_static = torch.empty_like(data[0])

        def step():
            for p in params:
                p.grad = None
            loss = moe(x_static).float().square().mean()
            loss.backward()
            return loss

        losses = []
        if capture:
            x_static.copy_(data[0])
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):  # warm-up (the fused kernels' and QuACK's compiles); no update
                    step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                loss_static = step()
        for xb in data:
            x_static.copy_(xb)
            if capture:
                graph.replay()
                loss = loss_static.clone()
            else:
                loss = step()
            losses.append(loss.item())
            with torch.no_grad():
                for p in params:
                    p.sub_(0.5 * p.grad)
        return losses

    eager, captured = train(False), train(True)
    assert eager == pytest.approx(captured, rel=1e-3)
    assert eager[-1] < eager[0]
