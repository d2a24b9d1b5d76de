"""GPT-OSS against transformers' GptOssForCausalLM (fp32, tiny random models): logits and the
loss gradient after `python -m titan_fold.hf import`, with sinks, sliding-window and full layers,
biases and the clamp active (pre-activations past the limit); packed documents against HF run on
each document alone, a window reaching across the boundary; export bit for bit; MXFP4 experts
dequantized as transformers does, and a folder of them imported."""

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from titan_fold.checkpoint.files import read_hf_folder
from titan_fold.hf import main
from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.hf_adapter import ADAPTERS, args_from_hf_config
from titan_fold.models.hf_gpt_oss import dequantize_mxfp4

pytestmark = pytest.mark.slow  # transformers models and conversions: the full suite only

LIMIT = 7.0
CONFIG = dict(
    hidden_size=32,
    num_hidden_layers=2,  # layer_types default: sliding, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=67,
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=16,
    sliding_window=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    swiglu_limit=LIMIT,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=16,
    ),
)


def random_hf_model(folder, dtype=torch.float32):
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # norms away from 1; expert matrices large enough that gate and up pass the limit
            scale = 1.0 if "experts.gate_up_proj" == name.split("mlp.")[-1] else 0.3
            p.copy_(torch.randn_like(p) * scale + (1.0 if "norm" in name else 0.0))
    hf = hf.to(dtype)
    if folder is not None:
        hf.save_pretrained(folder)
    return hf


def our_model(dcp_folder, hf_folder):
    """Our model from the HF folder's config.json (aux loss off: the gradients compare the LM
    loss alone), weights from the imported DCP checkpoint."""
    _, args = args_from_hf_config(str(hf_folder))
    args.moe = replace(args.moe, load_balance="none")
    model = Transformer(args)
    model.init_weights()
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(dcp_folder), no_dist=True)
    model.load_state_dict(sd)
    return model.eval()


def tokens(n=2, s=20, seed=1):
    return torch.randint(0, CONFIG["vocab_size"], (n, s), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    hf = random_hf_model(root / "hf")
    main(["import", str(root / "hf"), str(root / "dcp")])
    return root, hf, our_model(root / "dcp", root / "hf")


def test_logits_and_loss_gradient_match_transformers(imported):
    root, hf, model = imported
    x = tokens()
    seen = {}
    hook = hf.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, a: seen.update(h=a[0]))
    theirs = hf(x).logits
    hook.remove()
    ours = model(x)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert theirs.std() > 0.1
    experts = hf.model.layers[0].mlp.experts
    pairs = seen["h"] @ experts.gate_up_proj + experts.gate_up_proj_bias[:, None]  # [E, T, 2 ffn]
    assert (pairs[..., ::2] > LIMIT).any() and (pairs[..., 1::2].abs() > LIMIT).any(), "the clamp is active"

    labels = torch.roll(x, -1, dims=1)
    for logits in (ours, theirs):
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    our_grads = ADAPTERS["gpt_oss"](model.args).to_hf({n: p.grad for n, p in model.named_parameters()})
    their_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert sorted(our_grads) == sorted(their_grads)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)
    assert their_grads["model.layers.0.self_attn.sinks"].abs().max() > 1e-4
    assert their_grads["model.layers.1.mlp.experts.down_proj_bias"].abs().max() > 1e-4
    model.zero_grad()


def test_packed_documents_match_each_document_alone(imported):
    """Two documents packed in one sample: the sliding layer's window (4) of the second document's
    first queries would reach into the first; each document's logits equal HF's on it alone."""
    _, hf, model = imported
    lengths = [7, 13]
    x = tokens(n=1, s=sum(lengths), seed=3)
    document_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    with torch.no_grad():
        ours = model(x, document_ids=document_ids)
        theirs = torch.cat([hf(part).logits for part in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_export_round_trips(imported, tmp_path):
    root, hf, _ = imported
    flavor = ["--model.name", "gpt_oss", "--model.flavor", "hf", "--model.hf_config", str(root / "hf" / "config.json")]
    main(["export", str(root / "dcp"), str(tmp_path / "out"), *flavor])
    before, after = read_hf_folder(str(root / "hf")), read_hf_folder(str(tmp_path / "out"))
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    written = json.load(open(tmp_path / "out" / "config.json"))
    assert written["model_type"] == "gpt_oss" and written["layer_types"] == ["sliding_attention", "full_attention"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, hf(x).logits, rtol=0, atol=0)


def mxfp4(shape, seed):
    """Random MXFP4 blocks [*shape, G, 16] and scales [*shape, G] (2^-3 .. 2^2) for shape[-1] = in."""
    *lead, inner = shape
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, inner // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(124, 130, (*lead, inner // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does():
    blocks, scales = mxfp4((3, 10, 64), seed=0)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert ours.abs().max() > 1 and (ours == 0).float().mean() < 0.2


def test_mxfp4_folder_imports(tmp_path):
    """A folder with MXFP4 experts (as published) imports to the model whose experts are their
    dequantized values; HF in fp32 with those values gives the same logits."""
    from safetensors.torch import save_file

    cfg = dict(CONFIG, hidden_size=64, intermediate_size=32)
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg)).eval()
    E, dim, ffn = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    tensors = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
        for i, layer in enumerate(hf.model.layers):
            for proj, out, inner in (("gate_up_proj", 2 * ffn, dim), ("down_proj", dim, ffn)):
                blocks, scales = mxfp4((E, out, inner), seed=10 * i + len(proj))
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                tensors[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                tensors[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    for name, p in hf.state_dict().items():
        if not name.endswith(("gate_up_proj", "down_proj")):
            tensors[name] = p.contiguous()
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(hf.config.to_json_string())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    main(["import", str(tmp_path / "hf"), str(tmp_path / "dcp")])
    model = our_model(tmp_path / "dcp", tmp_path / "hf")
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-4)


def test_flavor_sizes():
    """20b and 120b: the published totals and activated counts (embedding left out of the latter)."""
    for flavor, total, active in (("20b", 20.91e9, 3.61e9), ("120b", 116.83e9, 5.13e9)):
        args = FLAVORS["gpt_oss"][flavor]
        with torch.device("meta"):
            model = Transformer(args)
        n, flops = args.get_nparams_and_flops(model, 4096)
        assert abs(n - total) / total < 0.01, (flavor, n)
        assert abs(flops / 6 - active - args.attention_flops([4096]) / 4096 / 6) / active < 0.05, (flavor, flops)
