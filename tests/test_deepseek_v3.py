"""DeepSeek-V3 family against transformers' DeepseekV3ForCausalLM (a test-only dependency):
tiny random folders built here (q LoRA or not, YaRN or plain RoPE, expert groups or one)
imported through `python -m titan_fold.hf` give transformers' logits; export gives back every
tensor and a folder from_pretrained opens; FP8 blockwise checkpoints dequantize; bad configs
fail with one line naming the field. Routing and MTP against independent computations."""

import json
import math
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers
from helpers import python_m
from host_sync import no_host_sync
from safetensors.torch import load_file, save_file

from titan_fold.checkpoint.files import read_hf_folder
from titan_fold.hf import main
from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.deepseek_v3 import count_parameters
from titan_fold.models.hf_adapter import ADAPTERS, args_from_hf_config, hf_config
from titan_fold.models.hf_deepseek import dequantize_fp8, quantize_fp8
from titan_fold.models.mtp import IGNORE_INDEX, future_tokens
from titan_fold.moe import MoEArgs, Router

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
BASE = dict(
    vocab_size=300,
    hidden_size=48,
    intermediate_size=72,
    moe_intermediate_size=20,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=2,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=12,
    qk_nope_head_dim=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=256,
    rope_scaling=YARN,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
CASES = {
    "q_lora_yarn_groups": {},
    "no_q_lora_plain_rope_one_group": dict(
        q_lora_rank=None, rope_scaling=None, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0
    ),
    # transformers' defaults for the fields left out (num_key_value_heads 128 with 4 heads among them)
    "defaults": dict(num_key_value_heads=None),
    # V2-Lite-like mscale (cos/sin and softmax scaled), factor given apart from the lengths, no dense layer,
    # half-split rotary layout, tied embeddings
    "yarn_mscale_half_split_tied": dict(
        rope_scaling={
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        rope_interleave=False,
        first_k_dense_replace=0,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        n_shared_experts=1,
    ),
}


def random_hf_model(config: dict, folder, dtype=torch.float32):
    config = {k: v for k, v in config.items() if v is not None}
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms away from 1: a swapped norm would show
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        for module in hf.modules():
            if hasattr(module, "e_score_correction_bias"):  # choice differs from the scores' own top-k
                module.e_score_correction_bias.copy_(torch.randn_like(module.e_score_correction_bias) * 0.05)
    hf = hf.to(dtype)
    hf.save_pretrained(folder)
    return hf


def tokens(vocab, n=2, s=40, seed=1):
    return torch.randint(0, vocab, (n, s), generator=torch.Generator().manual_seed(seed))


def load_dcp_model(dcp_folder, hf_folder, mtp_layers=0):
    _, args = args_from_hf_config(str(hf_folder))
    args.mtp_layers = mtp_layers
    model = Transformer(args)
    model.init_weights()
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(dcp_folder), no_dist=True)
    model.load_state_dict(sd)
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_parity_and_exact_export(case, tmp_path):
    config = {**BASE, **CASES[case]}
    hf = random_hf_model(config, tmp_path / "hf")
    main(["import", str(tmp_path / "hf"), str(tmp_path / "dcp")])
    model = load_dcp_model(tmp_path / "dcp", tmp_path / "hf")
    x = tokens(config["vocab_size"])
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert theirs.std() > 0.1
    assert [layer.moe_enabled for layer in model.layers.values()] == [
        not hasattr(layer.mlp, "gate_proj") for layer in hf.model.layers
    ]

    main(
        [
            "export",
            str(tmp_path / "dcp"),
            str(tmp_path / "out"),
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "hf",
            "--model.hf_config",
            str(tmp_path / "hf"),
        ]
    )
    before, after = read_hf_folder(str(tmp_path / "hf")), read_hf_folder(str(tmp_path / "out"))
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    written = json.load(open(tmp_path / "out" / "config.json"))
    assert written["model_type"] == "deepseek_v3" and written["architectures"] == ["DeepseekV3ForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is transformers.DeepseekV3ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, theirs, rtol=0, atol=0)


def test_packaged_debug_flavor_against_transformers(tmp_path):
    """The debug flavor's config.json (as export writes it) builds the same model in transformers."""
    args = FLAVORS["deepseek_v3"]["debug"]
    hf = random_hf_model(hf_config("deepseek_v3", args), tmp_path / "hf")
    model = Transformer(args)
    model.init_weights()
    model.load_state_dict(ADAPTERS["deepseek_v3"](args).from_hf(load_file(tmp_path / "hf" / "model.safetensors")))
    x = tokens(args.vocab_size, s=48)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-4)


def fp8_folder(tmp_path, config):
    """A bf16 folder and its FP8 twin quantized here as DeepSeek publishes -> (original, fp8 tensors, quantized keys)."""
    random_hf_model(config, tmp_path / "hf", dtype=torch.bfloat16)
    original = read_hf_folder(str(tmp_path / "hf"))
    fp8 = {}
    quantized = [
        k
        for k, v in original.items()
        if v.dim() == 2 and "norm" not in k and "embed" not in k and "lm_head" not in k and ".gate.weight" not in k
    ]
    for key, value in original.items():
        if key in quantized:
            q, scale_inv = quantize_fp8(value)
            fp8[key], fp8[key[: -len(".weight")] + ".weight_scale_inv"] = q, scale_inv
        else:
            fp8[key] = value
    os.makedirs(tmp_path / "fp8")
    save_file(fp8, str(tmp_path / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    # the published folders have an index (torch's quantized reader needs it)
    json.dump(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in fp8}},
        open(tmp_path / "fp8" / "model.safetensors.index.json", "w"),
    )
    config_json = json.load(open(tmp_path / "hf" / "config.json"))
    config_json["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    json.dump(config_json, open(tmp_path / "fp8" / "config.json", "w"))
    return original, fp8, quantized


def test_fp8_checkpoint_dequantizes(tmp_path):
    """A bf16 folder quantized here as DeepSeek publishes (e4m3, a scale_inv per 128 x 128 block;
    weights of 200 x 300 leave partial blocks) imports to the dequantized weights, within e4m3's
    rounding of the bf16 original, and exports bf16 tensors."""
    config = {
        **BASE,
        "hidden_size": 200,
        "moe_intermediate_size": 136,
        "intermediate_size": 300,
        "num_hidden_layers": 2,
    }
    original, fp8, quantized = fp8_folder(tmp_path, config)

    main(["import", str(tmp_path / "fp8"), str(tmp_path / "dcp")])
    main(
        [
            "export",
            str(tmp_path / "dcp"),
            str(tmp_path / "out"),
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "hf",
            "--model.hf_config",
            str(tmp_path / "hf"),
            "--dtype",
            "bfloat16",
        ]
    )
    out = read_hf_folder(str(tmp_path / "out"))
    assert sorted(out) == sorted(original) and len(quantized) > 10
    for key in quantized:
        w, ref = out[key], original[key].float()
        assert w.dtype == torch.bfloat16
        # e4m3 keeps 3 mantissa bits: at most 1/16 relative error per element, beyond the block's tiny values
        scale = fp8[key[: -len(".weight")] + ".weight_scale_inv"].repeat_interleave(128, 0)[: ref.shape[0]]
        scale = scale.repeat_interleave(128, 1)[:, : ref.shape[1]]
        err = (w.float() - ref).abs()
        assert (err <= ref.abs() / 16 + scale * 2**-9 + 1e-6).all(), key
        assert torch.equal(w, dequantize_fp8(fp8[key], fp8[key[: -len(".weight")] + ".weight_scale_inv"]))
        assert err.max() > 0  # the test did quantize
    for key in set(original) - set(quantized):
        assert torch.equal(out[key], original[key]), key


def test_mtp_layer_is_skipped_or_imported(tmp_path):
    """The published layout: the MTP layer as model.layers.{n}, with its own embedding and head
    copies. Skipped (and reported) without mtp.num_layers; imported into mtp.layers.0 with it;
    exported back as the same tensors."""
    config = {**BASE, "num_hidden_layers": 3}
    random_hf_model({**config, "num_hidden_layers": 4}, tmp_path / "four")
    tensors = read_hf_folder(str(tmp_path / "four"))
    n = 3
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{n}.{name}.weight"] = torch.rand(48) + 0.5
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(48, 96) * 0.1
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    os.makedirs(tmp_path / "hf")
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    json.dump(
        {**json.load(open(tmp_path / "four" / "config.json")), "num_hidden_layers": 3, "num_nextn_predict_layers": 1},
        open(tmp_path / "hf" / "config.json", "w"),
    )

    r = python_m("titan_fold.hf", "import", str(tmp_path / "hf"), str(tmp_path / "skip"))
    assert r.returncode == 0, r.stderr
    mtp_keys = [k for k in tensors if k.startswith("model.layers.3.")]
    assert len(mtp_keys) == 44  # its block (7 attention, 2 norms, 29 MoE), 4 of its own, 2 copies
    assert "skipped 44 tensors of the Multi-Token Prediction layer(s) model.layers.3" in r.stderr
    main(["import", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--mtp.num_layers", "1"])
    model = load_dcp_model(tmp_path / "dcp", tmp_path / "hf", mtp_layers=1)
    assert torch.equal(model.mtp.layers["0"].eh_proj.weight, tensors["model.layers.3.eh_proj.weight"])
    assert torch.equal(model.mtp.layers["0"].block.moe.router.gate.weight, tensors["model.layers.3.mlp.gate.weight"])
    main(
        [
            "export",
            str(tmp_path / "dcp"),
            str(tmp_path / "out"),
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "hf",
            "--model.hf_config",
            str(tmp_path / "hf"),
            "--mtp.num_layers",
            "1",
        ]
    )
    out = read_hf_folder(str(tmp_path / "out"))
    assert sorted(out) == sorted(tensors)
    for key, value in tensors.items():
        assert torch.equal(out[key], value), key


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(q_lora_rank=0), "q_lora_rank = 0"),
        (dict(n_group=3), "n_group = 3: must divide n_routed_experts = 8"),
        (dict(topk_group=5), "topk_group = 5: must be in [1, n_group = 4]"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.rope_type = 'linear'"),
    ],
)
def test_bad_config_is_one_line(change, field, tmp_path):
    random_hf_model(BASE, tmp_path / "hf")
    config = json.load(open(tmp_path / "hf" / "config.json"))
    config.pop("rope_parameters", None)
    config.update(change)
    if "rope_scaling" not in change:
        config["rope_scaling"] = YARN
    json.dump(config, open(tmp_path / "hf" / "config.json", "w"))
    r = python_m("titan_fold.hf", "import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and field in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not os.path.exists(tmp_path / "dcp")


# ---------------------------------------------------------------- routing, MTP, sizes


def test_group_limited_routing_against_a_loop():
    """Group-limited top-k with the aux-free bias in the choice only, normalization and scaling,
    against a float64 per-token loop written out here."""
    torch.manual_seed(0)
    args = MoEArgs(
        num_experts=12,
        top_k=3,
        score_func="sigmoid",
        norm_topk_prob=True,
        num_groups=4,
        group_topk=2,
        routed_scaling_factor=2.5,
        load_balance="aux_free",
    )
    router = Router(16, args).double()
    router.expert_bias.copy_(torch.randn(12) * 0.3)
    x = torch.randn(50, 16, dtype=torch.float64)
    routing = router(x, seq_len=50)
    scores = torch.sigmoid(x @ router.gate.weight.T)
    for t in range(50):
        biased = scores[t] + router.expert_bias.double()
        group_score = [sorted(biased[g * 3 : (g + 1) * 3].tolist())[-2:] for g in range(4)]
        groups = sorted(range(4), key=lambda g: -sum(group_score[g]))[:2]
        allowed = [e for e in range(12) if e // 3 in groups]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[:3]
        assert sorted(routing.experts[t].tolist()) == sorted(chosen)
        want = {e: scores[t, e].item() / sum(scores[t, c].item() for c in chosen) * 2.5 for e in chosen}
        for e, p in zip(routing.experts[t].tolist(), routing.probs[t].tolist(), strict=True):
            assert abs(p - want[e]) < 1e-12


def test_mtp_loss_against_a_written_out_computation():
    """The MTP layer's cross-entropy on tokens two ahead, its scale and factor, its metric."""
    from titan_fold.models.mtp import mtp_stats_from, mtp_stats_values

    args = FLAVORS["deepseek_v3"]["debug"]
    args = type(args)(**{**vars(args), "mtp_layers": 1, "mtp_loss_scaling_factor": 0.3})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    seq = tokens(args.vocab_size, s=33)
    inputs, labels = seq[:, :-1], seq[:, 1:]
    future = future_tokens(inputs, labels, 1)
    assert torch.equal(future[:, :, 0, 0], seq[:, 1:])  # the MTP layer's input: the next token
    assert torch.equal(future[:, :-1, 0, 1], seq[:, 2:]) and (future[:, -1, 0, 1] == IGNORE_INDEX).all()
    model.mtp.loss_scale.fill_(1 / 50)
    h = {}
    model.norm.register_forward_hook(lambda m, a, o: h.setdefault("h", a[0]))
    logits = model(inputs, future_tokens=future)
    layer = model.mtp.layers["0"]
    e = model.tok_embeddings(seq[:, 1:])
    x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h["h"])], -1))
    x = layer.block(x, model.rope_cos[:32], model.rope_sin[:32])
    mtp_logits = model.output(layer.norm(x))[:, :-1]
    ce = F.cross_entropy(mtp_logits.reshape(-1, args.vocab_size), seq[:, 2:].reshape(-1), reduction="sum")
    with no_host_sync():  # the statistics stay on the device until read
        values = mtp_stats_values(model)
    assert math.isclose(mtp_stats_from(values)["mtp_loss"], ce.item() / (2 * 31), rel_tol=1e-5)
    assert mtp_stats_from(mtp_stats_values(model)) == {}  # reset
    # the gradient that reaches the MTP projection is that of factor * scale * ce
    (logits * 0).sum().backward(retain_graph=True)
    grad = layer.eh_proj.weight.grad.clone()
    layer.eh_proj.weight.grad = None
    (0.3 / 50 * ce).backward()
    torch.testing.assert_close(grad, layer.eh_proj.weight.grad, rtol=1e-4, atol=1e-7)


def test_flavor_sizes():
    flavors = FLAVORS["deepseek_v3"]
    assert round(count_parameters(flavors["671B"]) / 1e9) == 671
    assert round(count_parameters(flavors["16B"]) / 1e9, 1) == 15.7
    assert round(count_parameters(flavors["kimi_k2"]) / 1e12, 2) == 1.03
    # the MTP layer: one MoE block, its norms and projection; embedding and head are shared
    # (the published checkpoint stores copies of both: 671B + 11.6B + 2 x 0.93B = 685B as HF counts it)
    with_mtp = type(flavors["671B"])(**{**vars(flavors["671B"]), "mtp_layers": 1})
    extra = count_parameters(with_mtp) - count_parameters(flavors["671B"])
    copies = 2 * 129280 * 7168
    assert round((count_parameters(with_mtp) + copies) / 1e9, 1) == 684.5 and 11.5e9 < extra < 11.7e9


def test_trainer_imports_and_exports_hf(tmp_path):
    """`--checkpoint.initial_load_in_hf` and `--checkpoint.last_save_in_hf` on 2 ranks, MLA on tp 2
    (wkv_a and wk_rope cut out of kv_a_proj_with_mqa as DTensors) and experts on ep 2: with lr 0
    the exported folder holds the imported tensors, e_score_correction_bias included."""
    from helpers import torchrun

    random_hf_model(BASE, tmp_path / "hf")
    torchrun(
        2,
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(tmp_path / "hf"),
        "--job.dump_folder",
        str(tmp_path / "out"),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(tmp_path / "hf"),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_in_hf",
        "--optimizer.lr",
        "0",
        "--training.steps",
        "1",
        "--training.seq_len",
        "32",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--moe.load_balance",
        "none",
        config="debug_deepseek_v3.toml",
    )
    out = tmp_path / "out" / "checkpoint" / "step-1"
    before, after = read_hf_folder(str(tmp_path / "hf")), read_hf_folder(str(out))
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_trainer_loads_fp8_folder(tmp_path):
    """`--checkpoint.initial_load_in_hf_quantized`: the trainer reads the FP8 folder through
    torch's quantized HF reader (dequantized per 128 x 128 block, float32), under tp 2; with lr 0
    the exported weights are the dequantized ones."""
    from helpers import torchrun

    config = {
        **BASE,
        "hidden_size": 200,
        "moe_intermediate_size": 136,
        "intermediate_size": 300,
        "num_hidden_layers": 2,
    }
    original, fp8, quantized = fp8_folder(tmp_path, config)
    torchrun(
        2,
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(tmp_path / "fp8"),
        "--job.dump_folder",
        str(tmp_path / "out"),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(tmp_path / "fp8"),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_in_hf_quantized",
        "--checkpoint.last_save_in_hf",
        "--optimizer.lr",
        "0",
        "--training.steps",
        "1",
        "--training.seq_len",
        "32",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--moe.load_balance",
        "none",
        config="debug_deepseek_v3.toml",
    )
    after = read_hf_folder(str(tmp_path / "out" / "checkpoint" / "step-1"))
    assert sorted(after) == sorted(original)
    for key in quantized:
        scale = fp8[key[: -len(".weight")] + ".weight_scale_inv"]
        torch.testing.assert_close(after[key], dequantize_fp8(fp8[key], scale, torch.float32), rtol=0, atol=0)
    for key in set(original) - set(quantized):
        assert torch.equal(after[key], original[key].float()), key
