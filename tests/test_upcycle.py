"""Upcycling: an MoE made from a dense model computes the dense model's logits at step 0."""

import dataclasses

import pytest
import torch

from titan_fold.checkpoint.upcycle import upcycle_state_dict
from titan_fold.models import FLAVORS, Transformer
from titan_fold.upcycle import main


def moe_args(family: str, **moe_changes):
    args = FLAVORS[family]["debug"]
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **moe_changes))


def dense_model(args, seed=0):
    torch.manual_seed(seed)
    # every layer a SwiGLU of ffn_dim (a flavor without dense layers: of the experts' width)
    ffn_dim = args.ffn_dim or args.moe.moe_ffn_dim
    dense = Transformer(dataclasses.replace(args, first_k_dense=args.n_layers, ffn_dim=ffn_dim))
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
    # Qwen3.5-MoE: linear-attention layers copied as they are, renormalized top-k, gated shared expert
    "qwen3_5_plain": ("qwen3_5_moe", {}, 1, 0.02),
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


def test_refuses_experts_no_dense_model_has():
    """GPT-OSS's experts (clamped SwiGLU with biases) are no copy of a dense SwiGLU FFN."""
    from titan_fold.checkpoint.upcycle import UpcycleError, check_upcycle

    refused = None
    try:
        check_upcycle(FLAVORS["gpt_oss"]["debug"], 1, 0.0)
    except UpcycleError as e:
        refused = str(e)
    assert refused is not None and "clamped_swiglu with biases" in refused, refused


def test_wrong_width_is_rejected():
    args = moe_args("mixtral", moe_ffn_dim=32)  # 128 / 32 = 4, not 2
    with pytest.raises(ValueError, match="moe_ffn_dim 32 x granularity 2"):
        upcycle_state_dict(
            dense_model(args).state_dict(), moe_args("mixtral", num_experts=16, top_k=4, moe_ffn_dim=32), 2, 0.02
        )


def test_cli_dense_dcp_to_moe_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    args = FLAVORS["mixtral"]["debug"]
    dense = dense_model(args)
    dcp.save(dense.state_dict(), checkpoint_id=str(tmp_path / "dense"))
    main(
        [
            "--dense",
            str(tmp_path / "dense"),
            "--out",
            str(tmp_path / "moe"),
            "--model.name",
            "mixtral",
            "--model.flavor",
            "debug",
        ]
    )
    moe = Transformer(args)
    sd = moe.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "moe"))
    moe.load_state_dict(sd)
    torch.testing.assert_close(logits(moe), logits(dense), rtol=0, atol=1e-5)


def cli(*args: str):
    from helpers import python_m

    return python_m("titan_fold.upcycle", *args)


def test_default_router_is_not_degenerate(tmp_path):
    """Without --router_std the tokens spread over the experts (not the same k for all), for a
    renormalizing router (exact) and for Qwen2-MoE's (within about 1% of the dense model)."""
    import torch.distributed.checkpoint as dcp

    for family in ("mixtral", "qwen2_moe"):
        args = (
            moe_args(family, moe_ffn_dim=FLAVORS[family]["debug"].ffn_dim)
            if family == "qwen2_moe"
            else moe_args(family)
        )
        dense = dense_model(dataclasses.replace(args, ffn_dim=args.moe.moe_ffn_dim))
        dcp.save(dense.state_dict(), checkpoint_id=str(tmp_path / f"{family}_dense"), no_dist=True)
        if family == "qwen2_moe":  # the flavor's own moe_ffn_dim is 32, the dense FFN 128: granularity 1 needs 128
            import titan_fold.checkpoint.upcycle as up

            sd = up.upcycle_state_dict(dense.state_dict(), args, 1, up.default_router_std(args))
        else:
            main(
                [
                    "--dense",
                    str(tmp_path / f"{family}_dense"),
                    "--out",
                    str(tmp_path / f"{family}_moe"),
                    "--model.name",
                    family,
                    "--model.flavor",
                    "debug",
                ]
            )
            sd = Transformer(args).state_dict()
            dcp.load(sd, checkpoint_id=str(tmp_path / f"{family}_moe"), no_dist=True)
        moe = Transformer(args)
        moe.load_state_dict(sd)
        tokens = torch.randint(0, args.vocab_size, (4, 64), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            got, want = moe(tokens), dense(tokens)
        stats = [layer.moe.stats for layer in moe.layers.values()]
        imbalance = max(float(s[2] / s[3]) for s in stats)  # max / mean tokens per expert
        assert imbalance < 2.0, (family, imbalance)  # a zero router gives E / k = 4
        tol = 1e-5 if args.moe.norm_topk_prob else 0.02 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_hf_dense_folder_to_moe(tmp_path):
    """A transformers Mistral built from a config and saved with save_pretrained (the documented
    way to make a small dense checkpoint) upcycles into a Mixtral of the same sizes: same logits."""
    import json

    import torch.distributed.checkpoint as dcp
    import transformers

    from titan_fold.models.hf_adapter import args_from_hf_config

    config = transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        sliding_window=None,
        rope_theta=1e6,
    )
    torch.manual_seed(0)
    mistral = transformers.MistralForCausalLM(config).eval()
    mistral.save_pretrained(tmp_path / "dense")
    moe_config = {
        **json.load(open(tmp_path / "dense" / "config.json")),
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "moe.json").write_text(json.dumps(moe_config))
    r = cli(
        "--dense",
        str(tmp_path / "dense"),
        "--hf",
        "--out",
        str(tmp_path / "moe"),
        "--model.name",
        "mixtral",
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(tmp_path / "moe.json"),
    )
    assert r.returncode == 0, r.stderr
    _, args = args_from_hf_config(str(tmp_path / "moe.json"))
    moe = Transformer(args)
    sd = moe.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "moe"), no_dist=True)
    moe.load_state_dict(sd)
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(tokens), mistral(tokens).logits, rtol=0, atol=1e-4)
    # a dense config that does not fit the MoE model is named field by field
    r = cli(
        "--dense",
        str(tmp_path / "dense"),
        "--hf",
        "--out",
        str(tmp_path / "moe2"),
        "--model.name",
        "mixtral",
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(tmp_path / "moe.json"),
        "--granularity",
        "2",
    )
    assert r.returncode == 2 and "intermediate_size: config.json 128, model 256" in r.stderr
    assert not (tmp_path / "moe2").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.flavor", "nope"], "--model.flavor 'nope': mixtral has debug, 8x7B, 8x22B, 8x22B-G8T8, hf"),
        (["--model.flavor", "debug", "--granularity", "0"], "--granularity 0: must be >= 1"),
        (["--model.flavor", "debug", "--granularity", "-2"], "--granularity -2: must be >= 1"),
        (["--model.flavor", "debug", "--granularity", "3"], "num_experts 8 and top_k 2 must be multiples of it"),
        (["--model.flavor", "debug", "--router_std", "-1"], "--router_std -1.0: must be >= 0"),
        # a 141B flavor against the tiny dense checkpoint: refused from the shapes, nothing built
        (["--model.flavor", "8x22B"], "tok_embeddings.weight: checkpoint [512, 64], model [32768, 6144]"),
    ],
)
def test_cli_errors_are_one_line(args, message, tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save(dense_model(FLAVORS["mixtral"]["debug"]).state_dict(), checkpoint_id=str(tmp_path / "dense"), no_dist=True)
    r = cli("--dense", str(tmp_path / "dense"), "--out", str(tmp_path / "moe"), "--model.name", "mixtral", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert message in r.stderr and r.stderr.startswith("error: ")
    assert not (tmp_path / "moe").exists()
