"""The seams a model family plugs into: the experts' activation on every CPU expert path against a
float64 per-expert reference (transformers' GptOssExperts formula), and the per-layer mixer table."""

import pytest
import torch

from titan_fold.models import TransformerArgs
from titan_fold.moe.activation import ExpertActivation
from titan_fold.moe.experts import GroupedExperts

CLAMPED = ExpertActivation("clamped_swiglu", alpha=1.702, limit=7.0)


def reference_experts(x, counts, w13, w2, b13, b2, p, alpha, limit):
    """GPT-OSS's experts as transformers writes them (gate = pairs[::2], up = pairs[1::2]), one
    expert at a time: (h @ w2 + b2) * p."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        gate_up = x[start : start + n] @ w13[e].T + b13[e]
        gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
        glu = gate * torch.sigmoid(gate * alpha)
        out.append(((up + 1) * glu @ w2[e].T + b2[e]) * p[start : start + n, None])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("path", ["loop", "torch", "padded"])
@pytest.mark.parametrize("prob_before_w2", [True, False])
def test_clamped_swiglu_with_biases_every_path(path, prob_before_w2):
    torch.manual_seed(0)
    E, dim, ffn, C = 4, 8, 16, 6
    experts = GroupedExperts(dim, ffn, E, "torch", activation=CLAMPED, bias=True)
    with torch.no_grad():  # weights large enough that gate and up pass the limit 7 both ways
        for p in experts.parameters():
            p.normal_(0, 2.0)
    counts = torch.tensor([C, 0, C - 2, 2 * C + 2]) if path != "padded" else C
    rows = C * E
    x = torch.randn(rows, dim)
    probs = torch.rand(rows)
    w = {n: t.detach().double().requires_grad_() for n, t in experts.named_parameters()}
    group = torch.full((E,), C) if path == "padded" else counts
    want = reference_experts(
        x.double(), group, w["w13"], w["w2"], w["w13_bias"], w["w2_bias"], probs.double(), 1.702, 7.0
    )
    pairs = x.double() @ w["w13"].detach().transpose(1, 2)  # [E, rows, 2 * ffn]
    assert (pairs[..., 0::2] > 7).any() and (pairs[..., 1::2] < -7).any(), "the clamp must be active"
    gy = torch.randn_like(want)
    want.backward(gy)
    if path == "loop":  # float64 rows take the per-expert loop
        got = experts.double()(x.double(), counts, probs.double(), prob_before_w2)
    else:
        assert experts.path(x, counts, None, ffn) == path
        got = experts(x, counts, probs, prob_before_w2)
    got.backward(gy.to(got.dtype))
    tol = dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    for name in ("w13_bias", "w2_bias", "w13"):
        torch.testing.assert_close(getattr(experts, name).grad.double(), w[name].grad, **tol)


def test_quack_names_why_it_cannot_serve():
    assert CLAMPED.quack_problem(biases=False) == "has a SwiGLU epilogue only, not the experts' clamped_swiglu"
    assert ExpertActivation().quack_problem(biases=True) == "adds no expert biases in its epilogue"
    assert ExpertActivation().quack_problem(biases=False) is None


def test_layer_types_pick_each_blocks_mixer():
    from titan_fold.models.transformer import Transformer

    args = TransformerArgs(
        n_layers=3, layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=5
    )
    with torch.device("meta"):
        model = Transformer(args)
    assert [layer.attention.inner_attention.window for layer in model.layers.values()] == [5, None, 5]
    with pytest.raises(ValueError, match="unknown"):
        TransformerArgs(n_layers=1, layer_types=("conv",))
    from titan_fold.models.args import LAYER_TYPES
    from titan_fold.models.transformer import MIXERS

    assert set(MIXERS) == set(LAYER_TYPES)  # every layer type has its mixer


def test_attend_window_and_sinks_limits():
    """A window of 1 leaves each query its own value; a sink of -inf changes nothing, one of +inf
    takes the whole softmax (output 0); a window as long as the sequence is plain causal."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from titan_fold.models.attention import attend

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    causal = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, window=1), v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(attend(q, k, v, window=6), causal)
    torch.testing.assert_close(attend(q, k, v, sinks=torch.full((4,), -torch.inf)), causal)
    assert attend(q, k, v, sinks=torch.full((4,), 1e4)).abs().max() < 1e-6


def test_sliding_layers_count_their_window_in_the_flops():
    """Query-key pairs per layer: n^2 with full attention; 2 n w - w^2 past a window w (n^2 within it)."""
    args = TransformerArgs(
        dim=64, n_heads=4, n_layers=2, layer_types=("sliding_attention", "full_attention"), sliding_window=8
    )
    per_pair = 6 * 4 * 16  # 6 x heads x head_dim
    sliding = 4**2 + (2 * 20 * 8 - 8**2)
    assert args.attention_flops([4, 20]) == per_pair * (sliding + 4**2 + 20**2)
