"""HF interop: a tiny random transformers model and ours give the same logits after import,
and export gives back the HF tensors bit for bit (transformers is a test-only dependency)."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from titan_fold.models import FLAVORS, Transformer  # noqa: E402
from titan_fold.models.hf_adapter import ADAPTERS, hf_config  # noqa: E402

HF_CLASSES = {
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
}


def tiny_args(family: str, **changes):
    args = dataclasses.replace(FLAVORS[family]["debug"], max_seq_len=64, **changes)
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, load_balance="none", z_loss_coeff=0.0))


def random_hf_model(family: str, args, folder) -> dict[str, torch.Tensor]:
    config_cls, model_cls = HF_CLASSES[family]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**hf_config(family, args))).eval()
    with torch.no_grad():
        for p in hf.parameters():  # norms too: ones would hide a swapped norm
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] == args.dim else 0.0))
    hf.save_pretrained(folder)
    return hf


@pytest.mark.parametrize(
    "family,changes",
    [
        ("qwen2_moe", {}),
        # norm_topk_prob on, and the first layer dense (HF mlp_only_layers)
        ("qwen2_moe", {"first_k_dense": 1}),
        ("mixtral", {}),
    ],
)
def test_hf_parity_and_round_trip(family, changes, tmp_path):
    args = tiny_args(family, **changes)
    if changes.get("first_k_dense"):
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, norm_topk_prob=True))
    hf = random_hf_model(family, args, tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")  # per-expert names, as on the Hub

    adapter = ADAPTERS[family](args, None)
    model = Transformer(args)
    model.init_weights()
    missing, unexpected = model.load_state_dict(adapter.from_hf(on_disk), strict=False)
    assert unexpected == []
    assert missing == [k for k in model.state_dict() if k.endswith("router.expert_bias")]

    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert ours.shape == theirs.shape == (2, 48, args.vocab_size)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # routing is not degenerate: the chosen experts differ between tokens
    router = model.layers[str(args.n_layers - 1)].moe.router.gate
    h = torch.randn(64, args.dim)
    assert router(h).topk(args.moe.top_k).indices.unique().numel() > args.moe.top_k

    exported = adapter.to_hf(model.state_dict())
    assert sorted(exported) == sorted(on_disk)
    for key, value in on_disk.items():
        assert torch.equal(exported[key], value), key


def test_unknown_and_missing_experts():
    args = tiny_args("mixtral")
    adapter = ADAPTERS["mixtral"](args, None)
    with pytest.raises(KeyError, match="model.layers.0.mlp.gate.weight"):
        adapter.from_hf({"model.layers.0.mlp.gate.weight": torch.zeros(8, 64)})
    partial = {f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight": torch.zeros(128, 64) for e in range(7)}
    with pytest.raises(ValueError, match="experts"):
        adapter.from_hf(partial)


def test_trainer_imports_and_exports_hf(tmp_path):
    """`--checkpoint.initial_load_in_hf` then `--checkpoint.last_save_in_hf` on 2 ranks, attention
    on tp=2 and experts on ep=2 (DTensors everywhere): with lr 0 the exported safetensors equal
    the imported ones."""
    from conftest import torchrun

    args = dataclasses.replace(FLAVORS["qwen2_moe"]["debug"], max_seq_len=128)
    random_hf_model("qwen2_moe", args, tmp_path / "hf")
    torchrun(2, "--job.dump_folder", str(tmp_path / "out"), "--checkpoint.enable",
             "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf",
             "--checkpoint.last_save_in_hf", "--optimizer.lr", "0", "--training.steps", "1",
             "--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2")
    before = load_file(tmp_path / "hf" / "model.safetensors")
    after = load_file(tmp_path / "out" / "checkpoint" / "step-1" / "model-00001-of-00001.safetensors")
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_cli_import_export_round_trip(tmp_path):
    """`python -m titan_fold.hf import` then `export`: same tensors, and transformers opens the export."""
    from titan_fold.hf import main

    args = FLAVORS["mixtral"]["debug"]
    hf = random_hf_model("mixtral", args, tmp_path / "hf")
    main(["import", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--model.name", "mixtral", "--model.flavor", "debug"])
    main(["export", str(tmp_path / "dcp"), str(tmp_path / "out"), "--model.name", "mixtral", "--model.flavor", "debug"])
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf(tokens).logits, rtol=0, atol=0)


def test_cli_import_rejects_other_flavor(tmp_path):
    from titan_fold.checkpoint import CheckpointError
    from titan_fold.hf import main

    random_hf_model("mixtral", FLAVORS["mixtral"]["debug"], tmp_path / "hf")
    with pytest.raises(ValueError, match="has 8 experts .*the model 64"):
        main(["import", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--model.name", "mixtral", "--model.flavor", "8x22B-G8T8"])
    # same expert count, other widths: the shapes are named
    with pytest.raises(CheckpointError, match=r"tok_embeddings.weight: checkpoint \[512, 64\], model \[32768, 6144\]"):
        main(["import", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--model.name", "mixtral", "--model.flavor", "8x22B"])
