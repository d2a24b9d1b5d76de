"""Upcycling: an MoE made from a dense model computes the dense model's logits at step 0."""

import dataclasses

import pytest
import torch

from titan_fold.models import FLAVORS, Transformer
from titan_fold.upcycle import main, upcycle_state_dict


def moe_args(family: str, **moe_changes):
    args = FLAVORS[family]["debug"]
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **moe_changes))


def dense_model(args, seed=0):
    torch.manual_seed(seed)
    dense = Transformer(dataclasses.replace(args, first_k_dense=args.n_layers))  # every layer a SwiGLU of ffn_dim
    dense.init_weights()
    with torch.no_grad():  # norms away from 1, so that a norm left out would show
        for name, p in dense.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return dense


def logits(model, seed=1):
    tokens = torch.randint(0, model.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(tokens)


CASES = {
    # Qwen2-MoE: softmax, no renormalization, gated shared expert; zero router, W2 x E / k
    "qwen2_plain": ("qwen2_moe", dict(moe_ffn_dim=128), 1, 0.0),
    # Mixtral: renormalized top-2 over 8 copies; exact for any router
    "mixtral_plain": ("mixtral", {}, 1, 0.02),
    # granular: 8 copies x 2 segments = 16 experts of 64, top-4
    "mixtral_granular_2": ("mixtral", dict(num_experts=16, top_k=4, moe_ffn_dim=64), 2, 0.02),
    # 4 copies x 4 segments = 16 experts of 32, top-8 (= 2 whole copies)
    "mixtral_granular_4": ("mixtral", dict(num_experts=16, top_k=8, moe_ffn_dim=32), 4, 0.02),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_upcycled_moe_reproduces_dense(name):
    family, changes, granularity, router_std = CASES[name]
    args = moe_args(family, **changes)
    dense = dense_model(args)
    moe = Transformer(args)
    moe.load_state_dict(upcycle_state_dict(dense.state_dict(), args, granularity, router_std))
    expected, got = logits(dense), logits(moe)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # the model is really an MoE routing over several experts, and not a no-op
    assert all(layer.moe_enabled for layer in moe.layers.values())
    if router_std:
        gate = moe.layers["0"].moe.router.gate.weight
        assert gate.abs().sum() > 0 and torch.equal(gate[0], gate[granularity - 1])


def test_refuses_granular_without_renormalization():
    args = moe_args("qwen2_moe", num_experts=16, top_k=4, moe_ffn_dim=64)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        upcycle_state_dict(dense_model(args).state_dict(), args, granularity=2)


def test_wrong_width_is_rejected():
    args = moe_args("mixtral", moe_ffn_dim=32)  # 128 / 32 = 4, not 2
    with pytest.raises(ValueError, match="moe_ffn_dim 32 x granularity 2"):
        upcycle_state_dict(dense_model(args).state_dict(), moe_args("mixtral", num_experts=16, top_k=4, moe_ffn_dim=32), 2, 0.02)


def test_cli_dense_dcp_to_moe_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    args = FLAVORS["mixtral"]["debug"]
    dense = dense_model(args)
    dcp.save(dense.state_dict(), checkpoint_id=str(tmp_path / "dense"))
    main(["--dense", str(tmp_path / "dense"), "--out", str(tmp_path / "moe"),
          "--model.name", "mixtral", "--model.flavor", "debug"])
    moe = Transformer(args)
    sd = moe.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "moe"))
    moe.load_state_dict(sd)
    torch.testing.assert_close(logits(moe), logits(dense), rtol=0, atol=1e-5)
