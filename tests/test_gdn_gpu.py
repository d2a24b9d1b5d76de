"""The gated delta rule on fla's kernels (models/gdn_fla.py) against the recurrent definition in
float64, on one GPU: the output and the gradients of q, k, v, g and beta, one document per sample
and documents packed (the state restarts at each start), eager and under torch.compile with
fullgraph (the custom ops are one opaque call each). On the CPU, `problem` says why it cannot run,
and the banner line names the rule a linear-attention model runs and why."""

import pytest
import torch

from titan_fold.models import gdn_fla

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: fla's kernels are CUDA only")


def recurrent(q, k, v, g, beta, starts, scale):
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, S = 0 at a start; o_t = scale S_t^T q_t."""
    b, s, h, dk = q.shape
    out = []
    state = q.new_zeros(b, h, dk, v.shape[-1])
    for t in range(s):
        keep = (~starts[:, t]).to(q.dtype).view(b, 1, 1, 1) if t else torch.zeros_like(state[..., :1, :1])
        state = state * keep * g[:, t].exp()[..., None, None]
        kt, vt, bt = k[:, t], v[:, t], beta[:, t][..., None]  # [b, h, K], [b, h, V], [b, h, 1]
        error = vt - torch.einsum("bhk,bhkv->bhv", kt, state)
        state = state + torch.einsum("bhk,bhv->bhkv", kt * bt, error)
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(out, dim=1)


def _inputs(b, s, h, d, starts_at, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(b, s, h, d, device="cuda", generator=gen), dim=-1) for _ in "qk")
    v = torch.randn(b, s, h, d, device="cuda", generator=gen)
    g = -torch.rand(b, s, h, device="cuda", generator=gen) * 0.2
    beta = torch.rand(b, s, h, device="cuda", generator=gen)
    starts = torch.zeros(b, s, dtype=torch.bool, device="cuda")
    for row, at in starts_at:
        starts[row, at] = True
    return [q, k, v, g, beta], starts


def _check(fn, tensors, starts):
    scale = tensors[0].shape[-1] ** -0.5
    ref_in = [t.double().requires_grad_() for t in tensors]
    ours_in = [
        t.to(torch.bfloat16 if i in (0, 1, 2) else torch.float32).requires_grad_() for i, t in enumerate(tensors)
    ]
    ref = recurrent(*ref_in, starts, scale)
    out = fn(*ours_in, starts, scale)
    do = torch.randn_like(ref)
    ref.backward(do)
    out.float().backward(do.float())
    for name, got, want in [
        ("o", out, ref),
        *zip("q k v g beta".split(), [t.grad for t in ours_in], [t.grad for t in ref_in], strict=True),
    ]:
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 2e-2, (name, float(err))


CASES = [
    pytest.param(2, 192, [], id="one_document_per_sample"),
    pytest.param(2, 256, [(0, 37), (0, 64), (1, 200)], id="packed_documents"),
]


@GPU
@pytest.mark.parametrize("b, s, starts_at", CASES)
def test_fla_rule_matches_the_recurrence(b, s, starts_at):
    tensors, starts = _inputs(b, s, 4, 128, starts_at)
    assert gdn_fla.problem(tensors[0], tensors[2]) is None
    _check(gdn_fla.gated_delta_rule, tensors, starts)


@GPU
def test_fla_rule_compiles_without_a_graph_break():
    tensors, starts = _inputs(2, 256, 4, 128, [(1, 100)], seed=1)
    _check(torch.compile(gdn_fla.gated_delta_rule, fullgraph=True), tensors, starts)


def test_problem_names_the_cpu():
    x = torch.zeros(1, 4, 2, 128)
    assert gdn_fla.problem(x, x) == "fla's kernels need CUDA"


def test_banner_names_the_rule_and_why():
    from titan_fold.models import FLAVORS
    from titan_fold.trainer.banner import linear_attention_rule

    assert linear_attention_rule(FLAVORS["qwen3_moe"]["debug"]) is None  # no linear-attention layers
    rule = linear_attention_rule(FLAVORS["qwen3_5_moe"]["debug"])
    if torch.cuda.is_available():
        assert rule in ("fla's CUDA kernels",) or rule.startswith("the torch chunked rule (")
    else:
        assert rule == "the torch chunked rule (fla's kernels need CUDA)"
