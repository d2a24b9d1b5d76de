"""Gated DeltaNet (models/gated_deltanet.py): the chunked rule against the recurrent definition in
float64, and the layer against transformers' Qwen3.5 / Qwen3-Next layers run document by document
(a packed sample must equal its documents run apart: state and convolution restart at each)."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

from titan_fold.models.documents import document_positions
from titan_fold.models.gated_deltanet import GatedDeltaNet, chunk_gated_delta_rule
from titan_fold.models.hf_qwen35 import Qwen35Names
from titan_fold.models.qwen3_5 import Qwen35Args


def recurrent_reference(q, k, v, g, beta, starts, scale):
    """o_t = scale * S_t^T q_t, S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, in
    float64, token by token; S = 0 at each document start. q, k [b, s, H, K], v [b, s, H, V]."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    b, s, h, dk = q.shape
    out = []
    for i in range(b):
        state = torch.zeros(h, dk, v.shape[-1], dtype=torch.float64)
        rows = []
        for t in range(s):
            if starts[i, t]:
                state = torch.zeros_like(state)
            kt, vt, bt = k[i, t], v[i, t], beta[i, t, :, None, None]
            forget = torch.eye(dk, dtype=torch.float64) - bt * kt[:, :, None] * kt[:, None, :]  # [H, K, K]
            state = g[i, t].exp()[:, None, None] * (forget @ state) + bt * kt[:, :, None] * vt[:, None, :]
            rows.append(scale * torch.einsum("hkv,hk->hv", state, q[i, t]))
        out.append(torch.stack(rows))
    return torch.stack(out)


def test_chunked_rule_equals_the_recurrent_definition_in_float64():
    torch.manual_seed(0)
    b, s, h, dk, dv = 2, 45, 2, 8, 6
    q = F.normalize(torch.randn(b, s, h, dk), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(b, s, h, dk), dim=-1).requires_grad_()
    v = torch.randn(b, s, h, dv, requires_grad=True)
    # head 0 keeps its state for tens of tokens, head 1 forgets within a few (a chunk's decay sums
    # reach -400: exp of their differences across documents would overflow)
    g = (-torch.rand(b, s, h) * torch.tensor([0.5, 30.0])).requires_grad_()
    beta = torch.rand(b, s, h, requires_grad=True)
    starts = torch.zeros(b, s, dtype=torch.bool)
    # documents starting inside a chunk, on a chunk's first token, one token long, and none
    starts[0, [0, 5, 16, 17, 30]] = True
    starts[1, 0] = True
    ours = chunk_gated_delta_rule(q, k, v, g, beta, starts, scale=0.7, chunk=16)
    ref = recurrent_reference(q, k, v, g, beta, starts, scale=0.7)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=1e-5)
    weights = torch.randn(b, s, h, dv, dtype=torch.float64)
    ours_grads = torch.autograd.grad((ours.double() * weights).sum(), (q, k, v, g, beta))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v, g, beta))
    for name, a, r in zip("q k v g beta".split(), ours_grads, ref_grads, strict=True):
        torch.testing.assert_close(a.double(), r.double(), rtol=0, atol=1e-5, msg=name)
    # the state reaches across chunks: doc 0 of sample 1 spans three of them
    assert ref[1, 40].abs().sum() > 0


HF_LAYERS = {
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet),
    "qwen3_next": (transformers.Qwen3NextConfig, modeling_qwen3_next.Qwen3NextGatedDeltaNet),
}


@pytest.mark.parametrize("family", sorted(HF_LAYERS))
def test_layer_on_packed_documents_equals_transformers_document_by_document(family):
    config_cls, layer_cls = HF_LAYERS[family]
    config = config_cls(
        hidden_size=24,
        num_hidden_layers=1,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    hf = layer_cls(config, layer_idx=0)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # gated norm away from 1, decays in a useful range
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name == "norm.weight" else 0.0))
    args = Qwen35Args(
        dim=24,
        linear_n_key_heads=2,
        linear_n_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel=4,
        norm_eps=1e-6,
    )
    ours = GatedDeltaNet(args)
    names = Qwen35Names(args, family)
    loaded = {}
    for name, value in hf.state_dict().items():
        loaded.update(names._gdn_from_hf(f"linear_attn.{name}", value))
    ours.load_state_dict({k.removeprefix("attention."): v for k, v in loaded.items()}, strict=True)

    lengths = [[7, 1, 18, 6], [32]]  # documents of each packed sample, 32 tokens each
    document_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    x = torch.randn(2, 32, 24, requires_grad=True)
    out = ours(x, mask=document_positions(document_ids))
    weights = torch.randn_like(out)
    (grad_ours,) = torch.autograd.grad((out * weights).sum(), x)

    reference, x_ref = [], x.detach().clone().requires_grad_()
    for i, row in enumerate(lengths):
        pieces, start = [], 0
        for n in row:  # each document alone, as transformers computes a sample
            pieces.append(hf(x_ref[i : i + 1, start : start + n]))
            start += n
        reference.append(torch.cat(pieces, dim=1))
    reference = torch.cat(reference)
    (grad_ref,) = torch.autograd.grad((reference * weights).sum(), x_ref)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-4, atol=1e-5)
    assert reference.std() > 0.01


def test_fake_tensors_take_the_rule_as_one_op():
    """The dry run's fake-tensor step runs the rule as one op (forward and backward), not the
    chunk loop's hundreds of calls; the op's body computes what the rule computes, gradients too."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_fold.models.gated_deltanet import _rule, gated_delta_rule

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    def inputs(b=2, s=96, h=4, d=16):
        gen = torch.Generator().manual_seed(0)
        q, k = (F.normalize(torch.randn(b, s, h, d, generator=gen, dtype=torch.float64), dim=-1) for _ in "qk")
        v = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)
        g = -torch.rand(b, s, h, generator=gen, dtype=torch.float64) * 0.2
        beta = torch.rand(b, s, h, generator=gen, dtype=torch.float64)
        return [t.requires_grad_() for t in (q, k, v, g, beta)]

    starts = torch.zeros(2, 96, dtype=torch.bool)
    starts[0, 40] = True
    with FakeTensorMode(allow_non_fake_inputs=True):  # as the dry run's step
        fake = inputs()
        with Ops() as ops:
            gated_delta_rule(*fake, starts).sum().backward()
    rule_ops = [n for n in ops.names if "gated_delta_rule" in n]
    aten = [n for n in ops.names if n.startswith("aten.")]  # the loss and autograd's own; the loop: hundreds
    assert len(rule_ops) == 2 and len(aten) < 20, ops.names

    real, ref = inputs(), inputs()
    weight = torch.randn(2, 96, 4, 16, dtype=torch.float64)
    (_rule(*real, starts, 0.25) * weight).sum().backward()
    (chunk_gated_delta_rule(*ref, starts, scale=0.25) * weight).sum().backward()
    for got, want in zip(real, ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
