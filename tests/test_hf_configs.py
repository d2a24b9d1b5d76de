"""The published config.json of eight Hub models build titan_fold models (the `hf` flavor) on the
meta device with the parameter counts of their model cards, and match the packaged flavors;
fields that would change the computation are rejected by name."""

import glob
import json
import os

import pytest
import torch

from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.hf_adapter import HFConfigError, args_from_hf_config, config_mismatches, hf_config

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_configs")

# model card numbers: total and activated parameters (billions; activated counts the
# embedding table and the head, as the cards do)
PUBLISHED = {
    "Qwen1.5-MoE-A2.7B": ("qwen2_moe", None, 14.3, 2.7),
    "Qwen2-57B-A14B": ("qwen2_moe", "57B-A14B", 57.4, 14.2),
    "Qwen3-30B-A3B": ("qwen3_moe", "30B-A3B", 30.5, 3.3),
    "Qwen3-235B-A22B": ("qwen3_moe", "235B-A22B", 235.0, 22.0),
    "Mixtral-8x7B-v0.1": ("mixtral", "8x7B", 46.7, 12.9),
    "Mixtral-8x22B-v0.1": ("mixtral", "8x22B", 141.0, 39.0),
    # the cards' 3.61B / 5.13B activated leave out the 0.58B embedding table
    "gpt-oss-20b": ("gpt_oss", "20b", 20.91, 3.61 + 0.58),
    "gpt-oss-120b": ("gpt_oss", "120b", 116.83, 5.13 + 0.58),
}


def test_every_published_config_is_tested():
    assert sorted(os.path.basename(f)[:-5] for f in glob.glob(os.path.join(DATA, "*.json"))) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_builds_with_the_published_sizes(name):
    family, flavor, total_b, active_b = PUBLISHED[name]
    built_family, args = args_from_hf_config(os.path.join(DATA, name + ".json"))
    assert built_family == family
    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    active = total - routed + routed * args.moe.top_k // args.moe.num_experts
    assert abs(total / 1e9 - total_b) < 0.01 * total_b
    assert abs(active / 1e9 - active_b) < 0.02 * active_b
    assert args.get_nparams_and_flops(model, 4096)[0] == total
    if flavor is not None:  # the packaged flavor computes the same thing
        assert (
            config_mismatches(json.load(open(os.path.join(DATA, name + ".json"))), family, FLAVORS[family][flavor])
            == []
        )
    # and the config we would write for it reads back to the same model
    assert config_mismatches(hf_config(family, args), family, args) == []


def test_flavor_mismatch_lists_each_field():
    config = json.load(open(os.path.join(DATA, "Mixtral-8x7B-v0.1.json")))
    wrong = sorted(config_mismatches(config, "mixtral", FLAVORS["mixtral"]["8x22B"]))
    assert "hidden_size: config.json 4096, model 6144" in wrong
    assert "vocab_size: config.json 32000, model 32768" in wrong
    assert "num_hidden_layers: config.json 32, model 56" in wrong


BASE = {
    "qwen3_moe": "Qwen3-30B-A3B",
    "qwen2_moe": "Qwen1.5-MoE-A2.7B",
    "mixtral": "Mixtral-8x7B-v0.1",
}


@pytest.mark.parametrize(
    "family, change, field",
    [
        ("qwen3_moe", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        (
            "qwen3_moe",
            {"rope_theta": None, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "rope_parameters.rope_type",
        ),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        (
            "qwen2_moe",
            {
                "use_sliding_window": True,
                "sliding_window": 4096,
                "layer_types": ["full_attention"] * 23 + ["sliding_attention"],
            },
            "layers \\[23\\] slide",
        ),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen2_moe", {"mlp_only_layers": [24]}, "mlp_only_layers"),
        ("mixtral", {"sliding_window": 4096}, "sliding_window"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("mixtral", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ("mixtral", {"attention_dropout": 0.1}, "attention_dropout"),
        ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("mixtral", {"model_type": "llama"}, "model_type"),
    ],
)
def test_unsupported_fields_are_rejected_by_name(family, change, field):
    config = {**json.load(open(os.path.join(DATA, BASE[family] + ".json"))), **change}
    with pytest.raises(HFConfigError, match=field.replace(".", r"\.")):
        args_from_hf_config(config)


def test_fields_that_do_not_apply_are_accepted():
    # a window as long as the positions never applies; Qwen's window is read only with use_sliding_window
    config = {**json.load(open(os.path.join(DATA, "Mixtral-8x7B-v0.1.json"))), "sliding_window": 32768}
    assert args_from_hf_config(config)[1].moe.top_k == 2
    _, args = args_from_hf_config(os.path.join(DATA, "Qwen2-57B-A14B.json"))  # sliding_window 131072, unused
    assert args.dense_layers == ()
    # Qwen2-MoE with use_sliding_window but no layer that slides (max_window_layers 0), and a
    # window no shorter than the positions
    for change in (
        {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 8192},
    ):
        config = {**json.load(open(os.path.join(DATA, "Qwen1.5-MoE-A2.7B.json"))), **change}
        assert args_from_hf_config(config)[1].n_layers == 24


def test_dense_layers_follow_transformers():
    """mlp_only_layers and decoder_sparse_step: HF builds layer i sparse iff i not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    config = {
        **json.load(open(os.path.join(DATA, "Qwen3-30B-A3B.json"))),
        "num_hidden_layers": 6,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    _, args = args_from_hf_config(config)
    assert [args.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    written = hf_config("qwen3_moe", args)
    assert written["mlp_only_layers"] == [0, 2, 3, 4] and written["decoder_sparse_step"] == 1


def test_unknown_fields_are_reported(capsys):
    config = {**json.load(open(os.path.join(DATA, "Mixtral-8x7B-v0.1.json"))), "some_new_knob": 3}
    args_from_hf_config(config)
    assert "some_new_knob" in capsys.readouterr().err


def test_packaged_qwen3_configs_fit_their_world():
    """qwen3_30b_a3b.toml is the planner's first mapping for one node of 8; the debug config runs on 1 or 2."""
    from titan_fold.common.config import parse_args
    from titan_fold.trainer.preflight import check_layout

    layout = check_layout(parse_args(["--job.config_file", "qwen3_30b_a3b.toml"]), 8)
    assert (layout.dp_shard, layout.cp, layout.tp, layout.ep, layout.etp, layout.edp) == (2, 4, 1, 8, 1, 1)
    for world in (1, 2):
        check_layout(parse_args(["--job.config_file", "debug_qwen3_moe.toml"]), world)


def test_hf_flavor_in_the_job_config(tmp_path):
    """`--model.flavor hf` reads `--model.hf_config`; without it, or with another flavor, a ConfigError / UserError."""
    from titan_fold.common.config import ConfigError, parse_args
    from titan_fold.common.errors import UserError
    from titan_fold.trainer.preflight import model_args_from_config

    path = os.path.join(DATA, "Qwen3-30B-A3B.json")
    _, args = model_args_from_config(
        parse_args(["--job.config_file", "qwen3_30b_a3b.toml", "--model.flavor", "hf", "--model.hf_config", path])
    )
    assert config_mismatches(json.load(open(path)), "qwen3_moe", args) == [] and args.max_seq_len == 4096
    with pytest.raises(UserError, match="needs model.hf_config"):
        model_args_from_config(parse_args(["--job.config_file", "debug_qwen3_moe.toml", "--model.flavor", "hf"]))
    with pytest.raises(ConfigError, match="model.hf_config is read only with model.flavor = 'hf'"):
        parse_args(["--job.config_file", "debug_qwen3_moe.toml", "--model.hf_config", path])
    with pytest.raises(HFConfigError, match="model_type = 'qwen3_moe' but --model.name is 'mixtral'"):
        model_args_from_config(
            parse_args(
                [
                    "--job.config_file",
                    "debug_qwen3_moe.toml",
                    "--model.name",
                    "mixtral",
                    "--model.flavor",
                    "hf",
                    "--model.hf_config",
                    path,
                ]
            )
        )
