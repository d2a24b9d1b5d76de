"""Single-rank MoE layer against the float64 per-token reference and hand-computed losses."""

import math
from dataclasses import replace

import pytest
import torch
from helpers import DIM, FFN, make_layer, reference_moe
from host_sync import no_host_sync

from titan_fold.moe import MoE, MoEArgs, moe_stats, moe_stats_from, moe_stats_values, update_expert_bias


def make_input(dtype, b=2, s=12, seed=1, skew=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, DIM, generator=g, dtype=torch.float64)
    if skew:
        x = x.abs() + 0.5  # positive inputs so the skewed gate rows dominate
    return x.to(dtype).requires_grad_()


def run_layer(moe, x):
    y = moe(x)
    g = torch.Generator().manual_seed(7)
    upstream = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    (y * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return y.detach(), x.grad.clone(), grads, upstream


def run_reference(moe, x, upstream, args, chunks=1):
    names = ["router.gate.weight", "experts.w13", "experts.w2"]
    params = {n: p.detach().double().clone().requires_grad_() for n, p in moe.named_parameters() if n in names}
    xr = x.detach().double().flatten(0, 1).requires_grad_()
    y, kept, chosen = reference_moe(
        xr,
        params["router.gate.weight"],
        params["experts.w13"],
        params["experts.w2"],
        args,
        bias=moe.router.expert_bias.tolist(),
        chunks=chunks,
    )
    (y * upstream.double().flatten(0, 1)).sum().backward()
    return y.view(x.shape), xr.grad.view(x.shape), {n: p.grad for n, p in params.items()}, kept, chosen


CASES = [
    # (top_k, num_experts, capacity_factor, drop_policy, skew)
    (1, 8, None, "probs", 0.0),
    (2, 8, None, "probs", 0.0),
    (8, 16, None, "probs", 0.0),
    (1, 8, None, "probs", 0.3),
    (2, 8, 1.0, "probs", 0.0),
    (2, 8, 1.0, "position", 0.0),
    (1, 8, 1.25, "probs", 0.3),
    (2, 8, 1.0, "position", 0.3),
    (8, 16, 0.5, "probs", 0.0),
    (8, 16, 0.5, "position", 0.3),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("prob_before_w2", [True, False])
@pytest.mark.parametrize("top_k,num_experts,capacity_factor,drop_policy,skew", CASES)
def test_layer_matches_reference(dtype, prob_before_w2, top_k, num_experts, capacity_factor, drop_policy, skew):
    args = MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        moe_ffn_dim=FFN,
        token_drop="dropless" if capacity_factor is None else "drop",
        capacity_factor=capacity_factor,
        drop_policy=drop_policy,
        load_balance="none",
        prob_before_w2=prob_before_w2,
        norm_topk_prob=top_k == 2,
    )
    moe = make_layer(args, dtype, skew=skew)
    x = make_input(dtype, skew=skew)
    y, gx, grads, upstream = run_layer(moe, x)
    y_ref, gx_ref, grads_ref, kept, chosen = run_reference(moe, x, upstream, args)

    if skew:  # the case must really leave experts without tokens
        used = {e for c in chosen for e in c}
        assert len(used) < num_experts
    if capacity_factor is not None:  # and token drop must really drop
        assert len(kept) < x.shape[0] * x.shape[1] * top_k

    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y.double(), y_ref, **tol)
    torch.testing.assert_close(gx.double(), gx_ref, **tol)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name].double(), g, **tol, msg=name)

    stats = moe_stats([moe])
    T = x.shape[0] * x.shape[1]
    assert stats["dropped_token_frac"] == pytest.approx(1 - len(kept) / (T * top_k), abs=1e-6)
    load = [sum(c.count(e) for c in chosen) for e in range(num_experts)]
    assert stats["expert_load_imbalance"] == pytest.approx(max(load) / (sum(load) / num_experts), rel=1e-6)
    assert moe_stats([moe]) == {}  # reset


def test_moe_stats_leave_out_idle_layers_in_one_read():
    """moe_stats over a layer that ran twice and one that did not run (another micro-batch's
    stage, say) are the first layer's means alone, gathered on the device without a host sync
    and read from it in one transfer."""
    from torch.overrides import TorchFunctionMode

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", None) in ("tolist", "item", "__bool__", "__float__", "__int__"):
                self.count += 1
            return func(*args, **(kwargs or {}))

    args = MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=FFN, token_drop="drop", capacity_factor=1.0, load_balance="none")
    ran, idle = make_layer(args, torch.float32), make_layer(args, torch.float32, seed=1)
    with torch.no_grad():
        ran(make_input(torch.float32))
        ran(make_input(torch.float32, seed=2))
    sums, calls = ran.stats[:3].clone(), ran.stats[3].item()
    with no_host_sync():  # the values stay on the device until the one read (the trainer's host copy)
        values = moe_stats_values([ran, idle])
    with Reads() as reads:
        stats = moe_stats_from(values)
    assert reads.count == 1 and calls == 2
    want = (sums / calls).tolist()
    assert [stats[k] for k in ("moe_aux_loss", "dropped_token_frac", "expert_load_imbalance")] == pytest.approx(want)
    assert stats["dropped_token_frac"] > 0 and moe_stats([ran, idle]) == {}


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_drop_and_pad_equals_drop(drop_policy, dtype):
    args = MoEArgs(
        num_experts=8,
        top_k=2,
        moe_ffn_dim=FFN,
        token_drop="drop",
        capacity_factor=1.0,
        drop_policy=drop_policy,
        load_balance="aux_loss",
        shared_ffn_dim=6,
        shared_expert_gate=True,
    )
    results = []
    for token_drop in ("drop", "drop_and_pad"):
        moe = make_layer(replace(args, token_drop=token_drop), dtype, skew=2.0)
        results.append(run_layer(moe, make_input(dtype, skew=2.0)))
    (y0, gx0, g0, _), (y1, gx1, g1, _) = results
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y1, y0, **tol)
    torch.testing.assert_close(gx1, gx0, **tol)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], **tol, msg=name)


def test_shared_expert_with_gate():
    args = MoEArgs(
        num_experts=4, top_k=1, moe_ffn_dim=FFN, shared_ffn_dim=6, shared_expert_gate=True, load_balance="none"
    )
    moe = make_layer(args, torch.float64)
    x = make_input(torch.float64)
    y = moe(x)
    moe.shared_expert = None
    routed = moe(x)
    m = make_layer(args, torch.float64)  # same seed: same weights
    w1, w2, w3 = (getattr(m.shared_expert, n).weight for n in ("w1", "w2", "w3"))
    t = x.detach()
    se = (torch.nn.functional.silu(t @ w1.T) * (t @ w3.T)) @ w2.T
    gate = torch.sigmoid(t @ m.shared_expert_gate.weight.T)
    torch.testing.assert_close(y.detach(), routed.detach() + gate * se.detach())


# ---- router losses on a tiny example, by hand -----------------------------------------------


def tiny_router(load_balance, score_func="softmax", top_k=1, z=0.0, seq=4):
    """4 tokens, 4 experts, gate = identity: the logits are the inputs."""
    args = MoEArgs(
        num_experts=4,
        top_k=top_k,
        moe_ffn_dim=FFN,
        score_func=score_func,
        load_balance=load_balance,
        aux_loss_coeff=0.5,
        z_loss_coeff=z,
    )
    moe = MoE(4, args).double()
    moe.init_weights(0.1)
    with torch.no_grad():
        moe.router.gate.weight.copy_(torch.eye(4))
    logits = [[2.0, 1.0, 0.0, 0.0], [0.0, 3.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.2], [0.0, 0.1, 0.0, 0.3]]
    return moe, torch.tensor(logits, dtype=torch.float64), args


def softmax(row):
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def hand_balance(logits, top_k, score_func="softmax"):
    if score_func == "softmax":
        scores = [softmax(r) for r in logits]
        dist = scores
    else:
        scores = [[1 / (1 + math.exp(-v)) for v in r] for r in logits]
        dist = [[v / sum(r) for v in r] for r in scores]
    T, E = len(logits), len(logits[0])
    chosen = [sorted(range(E), key=lambda e: -scores[t][e])[:top_k] for t in range(T)]
    f = [sum(c.count(e) for c in chosen) / (T * top_k) for e in range(E)]
    P = [sum(dist[t][e] for t in range(T)) / T for e in range(E)]
    return E * sum(fe * pe for fe, pe in zip(f, P, strict=True))


@pytest.mark.parametrize("score_func,top_k", [("softmax", 1), ("softmax", 2), ("sigmoid", 2)])
def test_aux_loss_by_hand(score_func, top_k):
    moe, logits, _ = tiny_router("aux_loss", score_func, top_k)
    expected = hand_balance(logits.tolist(), top_k, score_func)
    # token 0: softmax [2,1,0,0] -> top-1 expert 0; token 1 -> 1; token 2 -> 0; token 3 -> 3
    routing = moe.router(logits, seq_len=4)
    assert routing.loss.item() == pytest.approx(0.5 * expected, rel=1e-12)
    assert routing.balance_loss.item() == pytest.approx(expected, rel=1e-12)


def test_seq_aux_loss_by_hand():
    moe, logits, _ = tiny_router("seq_aux_loss", top_k=1)
    rows = logits.tolist()
    expected = (hand_balance(rows[:2], 1) + hand_balance(rows[2:], 1)) / 2  # two sequences of 2
    routing = moe.router(logits, seq_len=2)
    assert routing.loss.item() == pytest.approx(0.5 * expected, rel=1e-12)
    assert expected != pytest.approx(hand_balance(rows, 1))  # the per-sequence value differs


def test_z_loss_by_hand():
    moe, logits, _ = tiny_router("none", z=0.1)
    expected = sum(math.log(sum(math.exp(v) for v in r)) ** 2 for r in logits.tolist()) / 4
    assert moe.router(logits, seq_len=4).loss.item() == pytest.approx(0.1 * expected, rel=1e-12)


def test_aux_loss_enters_backward_only():
    """The layer's output is unchanged; the gate's gradient gains coeff * scale * d(aux)/dW."""
    moe, logits, args = tiny_router("aux_loss", top_k=2, z=0.05)
    x = logits.view(1, 4, 4)
    moe.aux_loss_scale.fill_(0.25)
    y_with = moe(x)
    y_with.sum().backward()
    g_with = moe.router.gate.weight.grad.clone()

    plain, _, _ = tiny_router("none", top_k=2)
    plain.load_state_dict(moe.state_dict())
    y_plain = plain(x)
    y_plain.sum().backward()
    torch.testing.assert_close(y_with, y_plain)

    # the same losses written independently, differentiated by autograd
    W = moe.router.gate.weight.detach().clone().requires_grad_()
    lg = x[0] @ W.T
    s = lg.softmax(-1)
    chosen = s.detach().topk(2, -1).indices
    f = torch.zeros(4, dtype=torch.float64).index_add(0, chosen.flatten(), torch.ones(8, dtype=torch.float64)) / 8
    aux = 4 * (f * s.mean(0)).sum()
    z = torch.logsumexp(lg, -1).square().mean()
    (0.25 * (0.5 * aux + 0.05 * z)).backward()
    torch.testing.assert_close(g_with - plain.router.gate.weight.grad, W.grad)


def test_aux_free_bias():
    moe, logits, _ = tiny_router("aux_free")
    moe.args.aux_free_bias_update_rate = 0.01
    # loads: expert 0 gets tokens 0 and 2, expert 1 token 1, expert 3 token 3, expert 2 none
    moe(logits.view(1, 4, 4))
    calls = []
    update_expert_bias([moe], all_reduce=lambda t: calls.append(1) or t * 2)
    assert calls == [1]
    # mean load 1: expert 0 overloaded (down), 1 and 3 at the mean (unchanged), 2 idle (up)
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.01, 0.0, 0.01, 0.0])
    assert moe.tokens_per_expert.sum() == 0  # reset after the update

    # the bias changes the choice but not the combine weight
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))
    r = moe.router(logits, seq_len=4)
    assert r.experts.flatten().tolist() == [2, 2, 2, 2]
    torch.testing.assert_close(r.probs[:, 0], logits.softmax(-1)[:, 2])


def test_autocast_bf16_matches_fp32():
    # one-GPU training runs the layer under autocast with fp32 parameters and inputs
    torch.manual_seed(0)
    moe = MoE(64, MoEArgs(num_experts=4, top_k=2, moe_ffn_dim=32, shared_ffn_dim=32, shared_expert_gate=True))
    moe.init_weights(0.02)
    x = torch.randn(2, 16, 64)
    ref = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert y.dtype == torch.bfloat16
    assert (y.float() - ref).norm() / ref.norm() < 2e-2
    y.float().sum().backward()
    assert moe.experts.w13.grad.dtype == torch.float32 and moe.experts.w13.grad.abs().sum() > 0


@pytest.mark.parametrize("n,groups", [(0, 3), (1, 1), (40, 7), (300, 129), (300, 255), (300, 256), (200, 40000)])
def test_group_by(n, groups):
    """order: a stable sort by key; counts: bincount (empty groups included); pos: how many
    earlier items share the key. The keys sort as uint8 up to 255 groups, then int16, then int32."""
    from titan_fold.moe.dispatcher import group_by

    key = torch.randint(0, groups, (n,), generator=torch.Generator().manual_seed(n))
    order, counts, pos = group_by(key, groups)
    assert torch.equal(order, torch.tensor(sorted(range(n), key=lambda i: (int(key[i]), i)), dtype=torch.int64))
    assert torch.equal(counts, torch.bincount(key, minlength=groups))
    assert pos.tolist() == [int((key[:i] == key[i]).sum()) for i in range(n)]


@pytest.mark.parametrize("case", ["dropless", "dropped", "padded"])
def test_dispatch_and_combine_are_gathers_with_the_indexing_gradients(case):
    """_Dispatch / _Combine (gathers both ways) against x[token_of_row] and index_add, float64:
    same values, same gradients, and gradcheck (padded: rows of empty slots get token 0's
    gradient, which their zero weight stops)."""
    from titan_fold.moe.dispatcher import _Combine, _Dispatch, _inverse, _PermuteRows, group_by

    torch.manual_seed(0)
    T, k, E, dim = 12, 3, 4, 5
    key = torch.randint(0, E, (T * k,))
    if case != "dropless":
        key[::4] = E  # dropped assignments: an extra last group
    order, counts, pos = group_by(key, E + 1)
    if case == "padded":
        C = int(counts[:E].max())
        slot = torch.where(key < E, key * C + pos, E * C)
        assign = torch.full((E * C + 1,), T * k).scatter(0, slot, torch.arange(T * k))[: E * C]
        token_of_row, kept = torch.where(assign < T * k, assign // k, 0), assign < T * k
    else:
        token_of_row, slot = order // k, _inverse(order)
        kept = torch.arange(T * k) < int(counts[:E].sum())
    x = torch.randn(T, dim, dtype=torch.float64, requires_grad=True)
    dropped = case != "dropless"
    rows = _Dispatch.apply(x, token_of_row, slot, k, dropped)
    torch.testing.assert_close(rows, x[token_of_row])
    R = int(kept.sum()) if case == "dropped" else rows.shape[0]
    y_rows = torch.randn(R, dim, dtype=torch.float64, requires_grad=True)
    y = _Combine.apply(y_rows, token_of_row[:R], slot.clamp(max=R), k, dropped)
    live = kept[:R].unsqueeze(-1)  # padded: empty slots hold no assignment
    ref = torch.zeros(T, dim, dtype=torch.float64).index_add(0, token_of_row[:R], y_rows * live)
    torch.testing.assert_close(y, ref)
    g = torch.randn(rows.shape, dtype=torch.float64) * kept.unsqueeze(-1)
    (gx,) = torch.autograd.grad(rows, x, g)
    (gx_ref,) = torch.autograd.grad(x[token_of_row], x, g)
    torch.testing.assert_close(gx, gx_ref)
    gy = torch.randn(T, dim, dtype=torch.float64)
    (grows,) = torch.autograd.grad(y, y_rows, gy)
    torch.testing.assert_close(grows * live, gy[token_of_row[:R]] * live)  # empty slots: weight 0, unused
    if case != "padded":
        assert torch.autograd.gradcheck(
            lambda r: _Combine.apply(r, token_of_row[:R], slot.clamp(max=R), k, dropped),
            (y_rows.detach().requires_grad_(),),
        )
    perm = torch.randperm(T)
    assert torch.autograd.gradcheck(
        lambda t: _PermuteRows.apply(t, perm, _inverse(perm)),
        (torch.randn(T, dim, dtype=torch.float64, requires_grad=True),),
    )


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [64, 333])
def test_fused_kernels_match_float64(device, rows):
    """The fused SwiGLU on (gate, up) pairs, times the probability and alone, and on two tensors
    (forward, backward), and the gather-sum over k, as run on this device (one generated kernel
    each on CUDA, plain ops on the CPU), against float64 autograd of the unfused formula; two row
    counts share one compile."""
    from titan_fold.common.fused import fused
    from titan_fold.moe.rows import _sum_by_token
    from titan_fold.moe.swiglu import swiglu, swiglu_pairs

    g = torch.Generator().manual_seed(rows)
    a, b, gy = (torch.randn(rows, 96, generator=g, dtype=torch.float64) for _ in range(3))
    p = torch.rand(rows, 1, generator=g, dtype=torch.float64)

    def check(got, exp):
        err = (got.double().cpu().reshape(exp.shape) - exp).norm() / exp.norm()
        assert err < 6e-3, err  # bf16 rounding of the inputs and outputs only

    for with_p in (True, False):
        # the routed experts' form: gate and up alternate along the last dim of one tensor
        ref = [t.clone().requires_grad_() for t in (a, b, p)]
        want = torch.nn.functional.silu(ref[0]) * ref[1] * (ref[2] if with_p else 1)
        want.backward(gy)
        ab = torch.stack((a, b), -1).flatten(-2).to(device, torch.bfloat16).requires_grad_()
        pp = p.float().to(device).requires_grad_()
        y = swiglu_pairs(ab, pp if with_p else None)
        y.backward(gy.to(device, torch.bfloat16))
        assert y.shape == (rows, 96) and ab.grad.shape == (rows, 192)
        check(y, want.detach())
        check(ab.grad[:, 0::2], ref[0].grad)
        check(ab.grad[:, 1::2], ref[1].grad)
        if with_p:
            check(pp.grad, ref[2].grad)
    # two tensors, on [b, s, ffn] as the dense FFN and the shared expert call it
    ref = [t.clone().requires_grad_() for t in (a, b)]
    (torch.nn.functional.silu(ref[0]) * ref[1]).backward(gy)
    x = [t.to(device, torch.bfloat16).view(1, rows, 96).requires_grad_() for t in (a, b)]
    y = swiglu(*x)
    y.backward(gy.to(device, torch.bfloat16).view(1, rows, 96))
    assert y.shape == (1, rows, 96)
    for got, exp in [(y, torch.nn.functional.silu(a) * b)] + [(t.grad, r.grad) for t, r in zip(x, ref, strict=True)]:
        check(got, exp)

    k, dim = 4, 64
    tokens = rows // k + 1
    slot = torch.randperm(tokens * k, generator=g) % rows  # some rows read twice, some never
    rows_t = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    want = rows_t[slot].view(tokens, k, dim).sum(1)
    got = fused(_sum_by_token)(rows_t.to(device, torch.bfloat16), slot.to(device), k, False)
    assert got.dtype == torch.bfloat16
    assert ((got.double().cpu() - want).norm() / want.norm()) < 6e-3


def _twice_plus(x, y):
    return 2 * x + y


def test_swiglu_pairs_as_words_round_as_the_halves_do():
    """The routed experts' SwiGLU reads and writes bf16 (gate, up) pairs as one int32 word each;
    its output and the pairs' gradient equal, bit for bit, the same formula on the pairs' two
    strided bf16 halves, with and without p, special values included (infinities, NaN, negative
    zero, subnormals: the words carry their bits unchanged). On the CPU, where both run as
    written, so that a difference can only be the words'; the generated CUDA kernels are held
    to float64 by test_fused_kernels_match_float64."""
    from titan_fold.moe import swiglu as s

    g = torch.Generator().manual_seed(0)
    ab = (torch.randn(37, 2 * 48, generator=g) * 4).to(torch.bfloat16)
    ab[0, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 1e-40, -1e-40])
    p = torch.rand(37, 1, generator=g)
    dy = torch.randn(37, 48, generator=g).to(torch.bfloat16)
    words = s._as_bits(ab)
    assert words.dtype == torch.int32 and words.shape == (37, 48)

    def same(got, want):
        assert got.dtype == want.dtype and torch.equal(
            got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
            want.view(torch.int16) if want.dtype == torch.bfloat16 else want,
        )

    same(s._pairs_forward(words), s._pairs_forward(ab))
    same(s._pairs_prob_forward(words, p), s._pairs_prob_forward(ab, p))
    same(s._from_bits(s._pairs_backward(dy, words)), s._pairs_backward(dy, ab))
    grad_words, grad_p = s._pairs_prob_backward(dy, words, p)
    want_ab, want_p = s._pairs_prob_backward(dy, ab, p)
    same(s._from_bits(grad_words), want_ab)
    assert torch.equal(grad_p.isnan(), want_p.isnan()) and torch.equal(grad_p.nan_to_num(), want_p.nan_to_num())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: fused() compiles on CUDA only")
def test_fused_compiles_once_for_any_row_count():
    """One compile serves every row count, 0 and 1 too (an empty FSDP shard in the master
    step, a rank that receives one row): torch.compile would specialize those into a second
    compile, so they run as written."""
    from titan_fold.common.fused import fused

    torch._dynamo.reset()
    rows = [torch.randn(n, 8, device="cuda") for n in (64, 33)]
    for x in rows:
        torch.testing.assert_close(fused(_twice_plus)(x, x), 3 * x)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (1, 0, 17):
            x = torch.randn(n, 8, device="cuda")
            torch.testing.assert_close(fused(_twice_plus)(x, x), 3 * x)
