"""The transformer against independent references: float64 attention, hand-computed sizes."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titan_fold.models import FLAVORS, Transformer, TransformerArgs
from titan_fold.models.layers import apply_rope, apply_rope_qk, rope_cos_sin
from titan_fold.models.transformer import Attention


def build(args, seed=0, device="cpu"):
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_forward_shape_and_causality(name):
    args = FLAVORS[name]["debug"]
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (2, 24, args.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()

    t = 11
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % args.vocab_size
    logits2 = model(changed)
    # not bit-equal: the changed token moves between experts, so the expert GEMMs run on
    # other row counts and may round differently (~1e-7); a causality leak is far larger
    torch.testing.assert_close(logits2[:, :t], logits[:, :t], rtol=0, atol=1e-5)
    assert (logits2[:, t] - logits[:, t]).abs().max() > 1e-3


def reference_attention(x, wq, bq, wk, bk, wv, bv, wo, n_heads, n_kv_heads, theta, positions):
    """Per-head, per-query loops in float64; RoPE rotates pair (i, i + head_dim/2) by pos * theta^(-2i/head_dim)."""
    b, s, dim = x.shape
    hd = wq.shape[0] // n_heads
    q = (x @ wq.T + bq).view(b, s, n_heads, hd)
    k = (x @ wk.T + bk).view(b, s, n_kv_heads, hd)
    v = (x @ wv.T + bv).view(b, s, n_kv_heads, hd)

    def rope(t):
        out = torch.empty_like(t)
        for p in range(s):
            for i in range(hd // 2):
                a = positions[p] * theta ** (-2 * i / hd)
                c, sn = math.cos(a), math.sin(a)
                x1, x2 = t[:, p, :, i], t[:, p, :, i + hd // 2]
                out[:, p, :, i] = x1 * c - x2 * sn
                out[:, p, :, i + hd // 2] = x2 * c + x1 * sn
        return out

    q, k = rope(q), rope(k)
    out = torch.zeros(b, s, n_heads, hd, dtype=x.dtype)
    group = n_heads // n_kv_heads
    for h in range(n_heads):
        kv = h // group  # query head h reads K/V head h // group
        for i in range(s):
            scores = torch.stack([(q[:, i, h] * k[:, j, kv]).sum(-1) for j in range(i + 1)], -1) / math.sqrt(hd)
            out[:, i, h] = (scores.softmax(-1).unsqueeze(-1) * v[:, : i + 1, kv]).sum(1)
    return out.reshape(b, s, -1) @ wo.T


@pytest.mark.parametrize("offset", [0, 37])
def test_gqa_attention_matches_float64_reference(offset):
    args = TransformerArgs(dim=48, n_heads=6, n_kv_heads=2, qkv_bias=True, rope_theta=500.0, max_seq_len=64)
    torch.manual_seed(0)
    attn = Attention(args).double()
    for p in attn.parameters():
        nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    positions = torch.arange(9) + offset
    cos, sin = rope_cos_sin(args.head_dim, args.max_seq_len, args.rope_theta)
    got = attn(x, cos[positions].double(), sin[positions].double())
    want = reference_attention(
        x,
        attn.wq.weight,
        attn.wq.bias,
        attn.wk.weight,
        attn.wk.bias,
        attn.wv.weight,
        attn.wv.bias,
        attn.wo.weight,
        6,
        2,
        500.0,
        positions.tolist(),
    )
    # the RoPE table is float32: ~1e-7 relative error on the angles
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_batch", [False, True])
def test_rope_qk_equals_apply_rope_forward_and_backward(per_batch, dtype, device):
    """apply_rope_qk's autograd Function (one fused() call each way on CUDA) against apply_rope
    differentiated by autograd: on the CPU equal; on CUDA within one rounding of the dtype."""
    gen = torch.Generator().manual_seed(0)
    b, s, d = 2, 24, 16
    cos, sin = rope_cos_sin(d, s, 1000.0)
    if per_batch:  # positions given per sequence: [b, s, head_dim]
        perm = torch.stack([torch.randperm(s, generator=gen) for _ in range(b)])
        cos, sin = cos[perm], sin[perm]
    q, k = (torch.randn(b, s, h, d, generator=gen).to(dtype) for h in (6, 2))
    gq, gk = (torch.randn(b, s, h, d, generator=gen).to(dtype) for h in (6, 2))
    cos, sin = cos.to(device), sin.to(device)

    ref = [t.to(device, copy=True).requires_grad_() for t in (q, k)]
    out_ref = [apply_rope(t, cos, sin) for t in ref]
    torch.autograd.backward(out_ref, [gq.to(device), gk.to(device)])
    x = [t.to(device, copy=True).requires_grad_() for t in (q, k)]
    out = apply_rope_qk(*x, cos, sin)
    torch.autograd.backward(out, [gq.to(device), gk.to(device)])

    tol = {} if device == "cpu" else {"rtol": torch.finfo(dtype).eps, "atol": 1e-6}
    for a, r in [*zip(out, out_ref, strict=True), (x[0].grad, ref[0].grad), (x[1].grad, ref[1].grad)]:
        assert a.dtype == dtype and a.shape == r.shape
        if tol:
            torch.testing.assert_close(a, r, **tol)
        else:
            assert torch.equal(a, r)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_qk_equals_float64(dtype, device):
    """apply_rope_qk with Qwen3's q / k RMSNorms (their backward written out, one fused() call
    each way on CUDA) against the norms and apply_rope differentiated by autograd in float64:
    the output and the gradients of q, k and both norm weights, no further from it than the
    op-by-op path in the same dtype plus one rounding."""
    gen = torch.Generator().manual_seed(0)
    b, s, d = 2, 24, 16
    cos, sin = rope_cos_sin(d, s, 1000.0)
    q, k = (torch.randn(b, s, h, d, generator=gen) * 3 for h in (6, 2))
    gq, gk = (torch.randn(b, s, h, d, generator=gen) for h in (6, 2))
    weights = [1 + torch.randn(d, generator=gen) / 2 for _ in range(2)]

    def run(path, dtype, device):
        norms = [nn.RMSNorm(d, eps=1e-6).to(device, dtype) for _ in range(2)]
        with torch.no_grad():
            for norm, w in zip(norms, weights, strict=True):
                norm.weight.copy_(w)
        x = [t.to(device, dtype).requires_grad_() for t in (q, k)]
        table = torch.float64 if dtype == torch.float64 else torch.float32  # the RoPE table's dtype
        c, s_ = cos.to(device, table), sin.to(device, table)
        if path == "fused":
            out = apply_rope_qk(*x, c, s_, *norms)
        else:
            out = [apply_rope(norm(t), c, s_) for norm, t in zip(norms, x, strict=True)]
        torch.autograd.backward(out, [g.to(device, dtype) for g in (gq, gk)])
        return [t.double().cpu() for t in (*out, x[0].grad, x[1].grad, norms[0].weight.grad, norms[1].weight.grad)]

    want = run("ops", torch.float64, "cpu")
    got, ops = run("fused", dtype, device), run("ops", dtype, device)
    eps = torch.finfo(dtype).eps
    for g, o, w in zip(got, ops, want, strict=True):
        scale = w.abs().max().item()
        assert (g - w).abs().max() <= (o - w).abs().max() + 4 * eps * scale, ((g - w).abs().max(), (o - w).abs().max())
        torch.testing.assert_close(g, w, rtol=0, atol=(1e-5 if dtype == torch.float32 else 4e-2) * scale)


def test_norm_rope_qk_calls_hooked_norms():
    """A q / k norm with hooks on it (a parallel plan's, the dry run's gradient watch) is called,
    not bypassed: its hooks run, and the result is the fused path's."""
    gen = torch.Generator().manual_seed(1)
    cos, sin = rope_cos_sin(16, 8, 1000.0)
    q, k = (torch.randn(2, 8, h, 16, generator=gen) for h in (4, 2))
    norms = [nn.RMSNorm(16, eps=1e-6) for _ in range(2)]
    fused_out = apply_rope_qk(q, k, cos, sin, *norms)
    calls = []
    for norm in norms:
        norm.register_forward_pre_hook(lambda module, args: calls.append(module))
    hooked_out = apply_rope_qk(q, k, cos, sin, *norms)
    assert calls == norms
    for a, b in zip(hooked_out, fused_out, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_positions_argument():
    args = FLAVORS["qwen2_moe"]["debug"]
    model = build(args).double()
    with torch.no_grad():  # sharp attention, so that positions matter
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(30)
            layer.attention.wk.weight.mul_(30)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    base = model(tokens)
    torch.testing.assert_close(model(tokens, positions=torch.arange(16)), base, rtol=0, atol=0)
    # RoPE scores depend on position differences only: a common shift changes nothing
    torch.testing.assert_close(model(tokens, positions=torch.arange(16) + 100), base, rtol=1e-5, atol=1e-5)
    per_row = torch.stack([torch.arange(16), torch.arange(16) + 7])  # [b, s]
    torch.testing.assert_close(model(tokens, positions=per_row), base, rtol=1e-5, atol=1e-5)
    # a different relative layout does change the result
    assert (model(tokens, positions=torch.arange(16) * 2) - base).abs().max() > 1e-2


def test_layer_frequency():
    args = dataclasses.replace(FLAVORS["mixtral"]["debug"], n_layers=7, first_k_dense=1, moe_layer_freq=2)
    with torch.device("meta"):
        model = Transformer(args)
    pattern = ["moe" if hasattr(layer, "moe") else "dense" for layer in model.layers.values()]
    assert pattern == ["dense", "dense", "moe", "dense", "moe", "dense", "moe"]
    for layer in model.layers.values():
        assert hasattr(layer, "moe") != hasattr(layer, "feed_forward")
    assert model.layers["1"].feed_forward.w1.weight.shape == (args.ffn_dim, args.dim)
    total, flops = args.get_nparams_and_flops(model, 64)
    want_total, _, want_flops = hand_counts(args, 64)
    assert (total, flops) == (want_total, want_flops)


def test_meta_init_is_deterministic():
    args = FLAVORS["qwen2_moe"]["debug"]
    a, b, c = build(args, seed=3), build(args, seed=3), build(args, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    # non-persistent RoPE buffers are rebuilt by init_weights, not saved
    assert "rope_cos" not in sa
    hd = args.dim // args.n_heads
    pos, inv = torch.arange(args.max_seq_len).double(), args.rope_theta ** (-torch.arange(0, hd, 2).double() / hd)
    torch.testing.assert_close(a.rope_cos[:, : hd // 2].double(), torch.cos(pos[:, None] * inv), rtol=0, atol=1e-4)
    # depth-scaled residual writes; biases start at zero
    assert a.layers["3"].attention.wo.weight.std() < 0.6 * a.layers["0"].attention.wo.weight.std()
    assert a.layers["0"].attention.wq.bias.abs().max() == 0
    assert all(torch.isfinite(p).all() for p in a.parameters())


def hand_counts(a: TransformerArgs, seq_len: int):
    """Total and activated (no embedding table) parameter counts, from the formulas."""
    d, hd, m = a.dim, a.head_dim, a.moe
    attention = d * a.n_heads * hd * 2 + d * a.n_kv_heads * hd * 2
    if a.qkv_bias:
        attention += (a.n_heads + 2 * a.n_kv_heads) * hd
    if a.out_bias:
        attention += d
    if a.qk_norm:
        attention += 2 * hd
    norms = 2 * d
    expert = 3 * d * m.moe_ffn_dim
    fixed = d * m.num_experts + 3 * d * m.shared_ffn_dim + (d if m.shared_expert_gate else 0)
    moe_layers = sum(a.is_moe_layer(i) for i in range(a.n_layers))
    dense_layers = a.n_layers - moe_layers
    body = a.n_layers * (attention + norms) + dense_layers * 3 * d * a.ffn_dim + d
    total = body + moe_layers * (fixed + m.num_experts * expert) + 2 * a.vocab_size * d
    active = body + moe_layers * (fixed + m.top_k * expert) + a.vocab_size * d
    flops = 6.0 * active + 6.0 * a.n_layers * a.n_heads * hd * seq_len
    return total, active, flops


@pytest.mark.parametrize(
    "name, flavor, total_b, active_with_embedding_b",
    [
        ("qwen2_moe", "57B-A14B", 57.4, 14.2),
        ("mixtral", "8x7B", 46.7, 12.9),
        ("mixtral", "8x22B", 141.0, 39.0),
        ("mixtral", "8x22B-G8T8", 141.0, 22.3),  # 8 of 64 experts, each 1/8 wide
        ("qwen3_moe", "30B-A3B", 30.5, 3.35),  # the model card's "3.3B", cut after one decimal
        ("qwen3_moe", "235B-A22B", 235.0, 22.0),
    ],
)
def test_param_and_flop_counts(name, flavor, total_b, active_with_embedding_b):
    args = FLAVORS[name][flavor]
    with torch.device("meta"):
        model = Transformer(args)
    total, flops = args.get_nparams_and_flops(model, 4096)
    want_total, want_active, want_flops = hand_counts(args, 4096)
    assert total == want_total
    assert float(flops) == want_flops  # exact in float64 at these magnitudes (< 2**53)
    # the published sizes (activated as the model cards count it: with the embedding table)
    assert abs(total / 1e9 - total_b) < 0.01 * total_b
    assert (
        abs((want_active + args.vocab_size * args.dim) / 1e9 - active_with_embedding_b) < 0.01 * active_with_embedding_b
    )


def test_tied_embeddings_counted_once():
    args = dataclasses.replace(FLAVORS["mixtral"]["debug"], tie_embeddings=True)
    model = build(args)
    assert model.output.weight is model.tok_embeddings.weight
    total, flops = args.get_nparams_and_flops(model, 32)
    untied_total, untied_active, _ = hand_counts(args, 32)
    assert total == untied_total - args.vocab_size * args.dim
    assert flops == 6 * untied_active + 6 * args.n_layers * args.n_heads * args.head_dim * 32


def test_update_from_config():
    @dataclasses.dataclass
    class MoESection:
        top_k: int | None = None
        token_drop: str | None = None
        capacity_factor: float | None = None
        load_balance: str | None = None

    flavor = FLAVORS["qwen2_moe"]["debug"]
    args = dataclasses.replace(flavor)
    job = SimpleNamespace(
        training=SimpleNamespace(seq_len=96), moe=MoESection(top_k=4, token_drop="drop", capacity_factor=1.5)
    )
    args.update_from_config(job)
    assert args.max_seq_len == 96
    assert (args.moe.top_k, args.moe.capacity_factor, args.moe.load_balance) == (4, 1.5, flavor.moe.load_balance)
    assert flavor.moe.top_k == 2  # the flavor itself is untouched

    @dataclasses.dataclass
    class Unknown:
        no_such_field: int = 1

    with pytest.raises(TypeError):
        args.update_from_config(SimpleNamespace(training=SimpleNamespace(seq_len=8), moe=Unknown()))


def test_debug_flavor_trains():
    args = FLAVORS["qwen2_moe"]["debug"]
    model = build(args, seed=0)
    # a fixed batch of repeating phrases: learnable in a few steps
    g = torch.Generator().manual_seed(0)
    phrases = torch.randint(0, args.vocab_size, (4, 8), generator=g)
    batch = phrases.repeat(1, 3)[:, :17]  # [4, 17]
    inputs, labels = batch[:, :-1], batch[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0.9 * math.log(args.vocab_size)  # starts near uniform
    assert losses[-1] < 0.5 * losses[0]


def test_moe_layer_recompute():
    """Only the MoE layers run again in backward, and the gradients are unchanged."""
    from titan_fold.moe import MoE
    from titan_fold.parallel.parallelize import apply_moe_recompute

    args = FLAVORS["qwen2_moe"]["debug"]
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    grads, calls = [], []
    for recompute in (False, True):
        model = build(args)
        if recompute:
            apply_moe_recompute(model)
        n = [0]
        for m in model.modules():
            if isinstance(m, MoE):
                # a pre-hook: the recompute stops as soon as it has the saved tensors it needs
                m.register_forward_pre_hook(lambda *_, n=n: n.__setitem__(0, n[0] + 1))
        model(tokens).square().mean().backward()
        calls.append(n[0])
        grads.append({k.replace("_checkpoint_wrapped_module.", ""): p.grad for k, p in model.named_parameters()})
    n_moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    assert n_moe > 0 and calls == [n_moe, 2 * n_moe]
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=0, atol=0, msg=k)


def test_dense_layers_and_attention_options():
    """dense_layers (HF's mlp_only_layers) on top of the frequency rule; q/k norms and the wo bias
    are counted and change the output."""
    args = dataclasses.replace(
        FLAVORS["qwen3_moe"]["debug"], n_layers=5, moe_layer_freq=2, dense_layers=(2,), out_bias=True, qkv_bias=True
    )
    with torch.device("meta"):
        model = Transformer(args)
    assert [layer.moe_enabled for layer in model.layers.values()] == [True, False, False, False, True]
    assert model.layers["0"].attention.q_norm.weight.shape == (args.head_dim,) == (16,)
    assert model.layers["0"].attention.wq.weight.shape == (8 * 16, 64)  # head_dim != dim / n_heads
    assert model.layers["0"].attention.wo.bias.shape == (64,)
    total, flops = args.get_nparams_and_flops(model, 64)
    want_total, _, want_flops = hand_counts(args, 64)
    assert (total, flops) == (want_total, want_flops)
    built = build(args)
    x = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = built(x)
        built.layers["0"].attention.q_norm.weight.mul_(3.0)
        assert (built(x) - base).abs().max() > 1e-3


@pytest.mark.parametrize("family", sorted(FLAVORS))
def test_every_parameter_has_its_group(family):
    """models/groups.py puts every parameter of every family (with MTP, dense first layers and
    shared experts where the family has them) in the group its module computes."""
    from titan_fold.models.groups import parameter_group

    args = dataclasses.replace(FLAVORS[family]["debug"], mtp_layers=1)
    with torch.device("meta"):
        model = Transformer(args)
    groups = {name: parameter_group(name) for name, _ in model.named_parameters()}
    assert groups["tok_embeddings.weight"] == "embedding" and groups["output.weight"] == "head"
    assert groups["norm.weight"] == groups["layers.0.attention_norm.weight"] == "norms"
    for name, group in groups.items():
        expected = (
            "mtp"
            if name.startswith("mtp.")
            else "embedding"
            if name.startswith("tok_embeddings.")
            else "head"
            if name.startswith("output.")
            else "norms"
            if "norm" in name.rsplit(".", 2)[-2]
            else "router"
            if ".router." in name
            else "routed_experts"
            if ".moe.experts." in name
            else "shared_experts"
            if ".shared_expert" in name
            else "dense_ffn"
            if ".feed_forward." in name
            else "attention"
            if ".attention." in name
            else None
        )
        assert group == expected, (name, group)
    assert {"attention", "router", "routed_experts", "mtp"} <= set(groups.values())
