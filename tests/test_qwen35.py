"""Qwen3.5-MoE and Qwen3-Next against transformers: tiny random models imported through `python -m
titan_fold.hf` give transformers' logits and loss gradients on packed documents (transformers run
document by document), export gives back the HF tensors bit for bit and a folder from_pretrained
opens; the Hub's vision-language layout imports its text model, offline and as the trainer reads it."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers

from titan_fold.checkpoint.files import read_hf_folder
from titan_fold.hf import main
from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.hf_adapter import ADAPTERS, args_from_hf_config, config_mismatches, hf_config

TEXT = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=97,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=12,
    shared_expert_intermediate_size=20,
    rms_norm_eps=1e-6,
    # layers: linear, full, linear, linear (not the default pattern: layer_types is read)
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
CASES = {
    # the Hub's layout: the vision-language model, text under model.language_model., a vision tower
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(
            text_config=TEXT,
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
        )
    ),
    # norm_topk_prob false and a dense layer: the fields Qwen3-Next has and Qwen3.5 has not
    "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(**TEXT, norm_topk_prob=False, mlp_only_layers=[2], intermediate_size=24)
    ),
}
TEXT_MODEL = {"qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM, "qwen3_next": transformers.Qwen3NextForCausalLM}
LENGTHS = [[9, 1, 14], [24]]  # documents of each packed sample


def random_hf_model(family: str, folder):
    torch.manual_seed(0)
    hf = CASES[family]().eval()
    with torch.no_grad():
        for p in hf.parameters():  # norms away from their neutral values: a swap would show
            p.copy_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(folder)
    return hf


def text_logits(hf, tokens):
    """The text model's logits of token ids [1, s] (the vision-language model's on text alone)."""
    return hf(input_ids=tokens).logits


# the flavors' names: total and activated parameters (billions)
NAMED = {
    ("qwen3_5_moe", "35B-A3B"): (35, 3),
    ("qwen3_5_moe", "122B-A10B"): (122, 10),
    ("qwen3_5_moe", "397B-A17B"): (397, 17),
    ("qwen3_next", "80B-A3B"): (80, 3),
}


@pytest.mark.parametrize("family, flavor", sorted(NAMED))
def test_flavor_has_the_sizes_of_its_name_and_writes_its_config(family, flavor):
    args = FLAVORS[family][flavor]
    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    active = total - routed + routed * args.moe.top_k // args.moe.num_experts
    want_total, want_active = NAMED[family, flavor]
    assert abs(total / 1e9 - want_total) < 0.02 * want_total
    # the names round the activated count (Qwen3-Next-80B-A3B: 3.9B with the embedding and head)
    assert 0.9 * want_active <= active / 1e9 < 1.3 * want_active
    assert config_mismatches(hf_config(family, args), family, args) == []
    assert args.layer_types.count("full_attention") * 4 == args.n_layers


@pytest.mark.slow  # HF folders written and read: the full suite only
@pytest.mark.parametrize("family", sorted(CASES))
def test_import_parity_on_packed_documents_and_bit_exact_export(family, tmp_path, capfd):
    hf = random_hf_model(family, tmp_path / "hf")
    main(["import", str(tmp_path / "hf"), str(tmp_path / "dcp")])
    if family == "qwen3_5_moe":
        assert "skipped" in capfd.readouterr().err  # the vision tower, with a note
    _, args = args_from_hf_config(str(tmp_path / "hf"))
    model = Transformer(args)
    model.init_weights()
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model.load_state_dict(sd)
    assert [b.layer_type for b in model.layers.values()] == TEXT["layer_types"]
    # the trainer's checkpoint.initial_load_in_hf: DCP reads the folder itself through the adapter
    adapter = ADAPTERS[family](args)
    hf_sd = adapter.to_hf({k: torch.empty_like(v) for k, v in sd.items()})
    dcp.load(hf_sd, storage_reader=adapter.get_hf_storage_reader(str(tmp_path / "hf")), no_dist=True)
    read = adapter.from_hf(hf_sd)
    assert read.keys() == {name for name, _ in model.named_parameters()}
    assert all(torch.equal(read[k], sd[k]) for k in read)

    tokens = torch.randint(0, TEXT["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, TEXT["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    document_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in LENGTHS])
    ours = model(tokens, document_ids=document_ids)
    F.cross_entropy(ours.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    theirs, loss = [], 0
    for i, row in enumerate(LENGTHS):
        start = 0
        for n in row:  # each document alone: transformers has no packed path for linear attention
            logits = text_logits(hf, tokens[i : i + 1, start : start + n])
            loss = loss + F.cross_entropy(logits[0], labels[i, start : start + n], reduction="sum")
            theirs.append(logits[0])
            start += n
    loss.backward()
    torch.testing.assert_close(ours.detach().flatten(0, 1), torch.cat(theirs).detach(), rtol=0, atol=1e-4)
    assert torch.cat(theirs).std() > 0.1

    grads = adapter.to_hf({name: p.grad for name, p in model.named_parameters()})
    hf_grads = {n.replace("model.language_model.", "model."): p.grad for n, p in hf.named_parameters()}
    for name, grad in hf_grads.items():
        if name.startswith("model.visual."):
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # transformers stacks its experts
            prefix = name.rsplit(".", 1)[0]
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            ours_grad = torch.stack(
                [torch.cat([grads[f"{prefix}.{e}.{p}.weight"] for p in parts]) for e in range(grad.shape[0])]
            )
        else:
            ours_grad = grads[name]
        # float32 sums in another order: within 1e-4 of the gradient's largest entry
        assert (ours_grad - grad).abs().max() <= 1e-4 * grad.abs().max(), name

    main(
        [
            "export",
            str(tmp_path / "dcp"),
            str(tmp_path / "out"),
            "--model.name",
            family,
            "--model.flavor",
            "hf",
            "--model.hf_config",
            str(tmp_path / "hf" / "config.json"),
        ]
    )
    before = {
        k.replace("model.language_model.", "model."): v
        for k, v in read_hf_folder(str(tmp_path / "hf")).items()
        if not k.startswith("model.visual.")
    }
    after = read_hf_folder(str(tmp_path / "out"))
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    written = json.load(open(tmp_path / "out" / "config.json"))
    assert written["architectures"] == [TEXT_MODEL[family].__name__]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is TEXT_MODEL[family]
    with torch.no_grad():
        x = tokens[1:, :24]
        torch.testing.assert_close(reloaded(x).logits, text_logits(hf, x), rtol=0, atol=0)
