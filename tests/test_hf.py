"""HF interop against transformers (a test-only dependency): tiny random models of the three
families, with configs unlike the packaged flavors, imported through `python -m titan_fold.hf`
give transformers' logits; export gives back the HF tensors bit for bit and a folder that
from_pretrained opens; mismatched, truncated and broken folders fail with one line, exit 2,
and leave nothing behind."""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from helpers import python_m
from safetensors.torch import load_file

from titan_fold.checkpoint.files import read_hf_folder
from titan_fold.checkpoint.manager import CheckpointError
from titan_fold.hf import main
from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.hf_adapter import ADAPTERS, HFConfigError, HFKeyError, args_from_hf_config, hf_config

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

HF_CLASSES = {
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
}

# Configs unlike the packaged flavors: GQA and MQA, head_dim != hidden / heads, vocab not a
# multiple of 64, tied and untied, top-k 1 and > 2, norm_topk_prob both ways, dense layers
# among MoE layers (mlp_only_layers, decoder_sparse_step), qkv / attention biases or not.
CASES = {
    "qwen2_gqa_top1_sparse_step": (
        "qwen2_moe",
        dict(
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=99,
            num_experts=6,
            num_experts_per_tok=1,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=28,
            intermediate_size=36,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            rope_theta=5000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    "qwen2_mqa_top3_tied_nobias": (
        "qwen2_moe",
        dict(
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=130,
            num_experts=5,
            num_experts_per_tok=3,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=8,
            intermediate_size=24,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            qkv_bias=False,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_gqa_top3_bias_tied": (
        "qwen3_moe",
        dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=12,
            vocab_size=101,
            num_experts=5,
            num_experts_per_tok=3,
            moe_intermediate_size=20,
            intermediate_size=40,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            attention_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_mqa_top1_sparse_step": (
        "qwen3_moe",
        dict(
            hidden_size=40,
            num_hidden_layers=4,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=75,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            intermediate_size=24,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            rope_theta=20000.0,
        ),
    ),
    "mixtral_mha_top3_head_dim": (
        "mixtral",
        dict(
            hidden_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            vocab_size=77,
            num_local_experts=4,
            num_experts_per_tok=3,
            intermediate_size=24,
        ),
    ),
    "mixtral_mqa_top1_tied": (
        "mixtral",
        dict(
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=1,
            vocab_size=90,
            num_local_experts=3,
            num_experts_per_tok=1,
            intermediate_size=20,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
        ),
    ),
}


def random_hf_model(family: str, config: dict, folder, dtype=torch.float32):
    config_cls, model_cls = HF_CLASSES[family]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms away from 1: a swapped norm would show
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    hf = hf.to(dtype)
    hf.save_pretrained(folder)
    return hf


def load_dcp_model(dcp_folder, hf_folder):
    """Our model built from the HF folder's config.json, weights from the imported DCP checkpoint."""
    _, args = args_from_hf_config(str(hf_folder))
    model = Transformer(args)
    model.init_weights()
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(dcp_folder), no_dist=True)
    model.load_state_dict(sd)
    return model.eval()


def tokens(vocab, n=2, s=24, seed=1):
    return torch.randint(0, vocab, (n, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_parity_and_bit_exact_export(case, tmp_path):
    family, config = CASES[case]
    hf = random_hf_model(family, config, tmp_path / "hf")
    main(["import", str(tmp_path / "hf"), str(tmp_path / "dcp")])
    model = load_dcp_model(tmp_path / "dcp", tmp_path / "hf")
    x = tokens(config["vocab_size"])
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert ours.shape == theirs.shape == (2, 24, config["vocab_size"])
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
            family,
            "--model.flavor",
            "hf",
            "--model.hf_config",
            str(tmp_path / "hf" / "config.json"),
        ]
    )
    before, after = read_hf_folder(str(tmp_path / "hf")), read_hf_folder(str(tmp_path / "out"))
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    written = json.load(open(tmp_path / "out" / "config.json"))
    assert written["model_type"] == family and written["architectures"] == [HF_CLASSES[family][1].__name__]
    assert written["torch_dtype"] == "float32"
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is HF_CLASSES[family][1]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, theirs, rtol=0, atol=0)


@pytest.mark.parametrize(
    "case", ["qwen3_gqa_top3_bias_tied", "qwen2_gqa_top1_sparse_step", "mixtral_mha_top3_head_dim"]
)
def test_bf16_round_trip_and_sharded_export(case, tmp_path):
    """bf16 on the Hub -> DCP (bf16) -> HF, several files: bit for bit, torch_dtype bfloat16."""
    family, config = CASES[case]
    random_hf_model(family, config, tmp_path / "hf", dtype=torch.bfloat16)
    main(["import", str(tmp_path / "hf"), str(tmp_path / "dcp")])
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
            str(tmp_path / "hf"),
            "--max_shard_size",
            "20KB",
        ]
    )
    before, after = read_hf_folder(str(tmp_path / "hf")), read_hf_folder(str(tmp_path / "out"))
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert value.dtype == torch.bfloat16 and torch.equal(after[key], value), key
    files = sorted(os.listdir(tmp_path / "out"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    assert all(os.path.getsize(tmp_path / "out" / f) < 40_000 for f in shards)
    assert json.load(open(tmp_path / "out" / "config.json"))["torch_dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert next(reloaded.parameters()).dtype == torch.bfloat16
    # an fp32 checkpoint exported with --dtype bfloat16 gives the same bf16 tensors
    main(
        [
            "export",
            str(tmp_path / "dcp"),
            str(tmp_path / "out2"),
            "--model.name",
            family,
            "--model.flavor",
            "hf",
            "--model.hf_config",
            str(tmp_path / "hf"),
            "--dtype",
            "float32",
        ]
    )
    fp32 = read_hf_folder(str(tmp_path / "out2"))
    assert all(fp32[k].dtype == torch.float32 and torch.equal(fp32[k].bfloat16(), before[k]) for k in before)


def test_adapter_parity_on_packaged_flavors(tmp_path):
    """The packaged debug flavors of the three families against transformers, through the adapter."""
    for family in ("qwen2_moe", "qwen3_moe", "mixtral"):
        args = FLAVORS[family]["debug"]
        hf = random_hf_model(family, hf_config(family, args), tmp_path / family)
        model = Transformer(args)
        model.init_weights()
        missing, unexpected = model.load_state_dict(
            ADAPTERS[family](args).from_hf(load_file(tmp_path / family / "model.safetensors")), strict=False
        )
        assert unexpected == [] and missing == [k for k in model.state_dict() if k.endswith("router.expert_bias")]
        x = tokens(args.vocab_size, s=48)
        with torch.no_grad():
            torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-4)
        # routing is not degenerate: the chosen experts differ between tokens
        router = model.layers[str(args.n_layers - 1)].moe.router.gate
        assert router(torch.randn(64, args.dim)).topk(args.moe.top_k).indices.unique().numel() > args.moe.top_k


def test_unknown_and_missing_experts():
    args = FLAVORS["mixtral"]["debug"]
    adapter = ADAPTERS["mixtral"](args)
    with pytest.raises(HFKeyError, match="model.layers.0.mlp.gate.weight"):
        adapter.from_hf({"model.layers.0.mlp.gate.weight": torch.zeros(8, 64)})
    partial = {f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight": torch.zeros(128, 64) for e in range(7)}
    with pytest.raises(HFConfigError, match="experts"):
        adapter.from_hf(partial)


# ---------------------------------------------------------------- mismatches and broken files


def cli(*args: str):
    return python_m("titan_fold.hf", *args)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q3") / "hf"
    random_hf_model("qwen3_moe", CASES["qwen3_gqa_top3_bias_tied"][1], folder)
    return folder


def copy_folder(src, dst, config_changes=None):
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        if name == "config.json" and config_changes:
            data = json.dumps({**json.loads(data), **config_changes}).encode()
        with open(os.path.join(dst, name), "wb") as f:
            f.write(data)
    return dst


def test_config_mismatch_lists_every_field_and_writes_nothing(qwen3_folder, tmp_path):
    """Same tensor shapes, other computation: each field is named with both values, exit 2."""
    bad = copy_folder(
        qwen3_folder,
        tmp_path / "bad",
        {
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        },
    )
    good = tmp_path / "good.json"
    good.write_text((qwen3_folder / "config.json").read_text())
    r = cli(
        "import",
        str(bad),
        str(tmp_path / "dcp"),
        "--model.name",
        "qwen3_moe",
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(good),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1, line
    for text in (
        "num_experts_per_tok: config.json 2, model 3",
        "norm_topk_prob: config.json False, model True",
        "rope_theta: config.json 500.0",
        "rms_norm_eps: config.json 1e-05, model 1e-06",
    ):
        assert text in line
    assert not os.path.exists(tmp_path / "dcp") and not os.path.exists(tmp_path / "dcp.tmp")


def test_packaged_flavor_against_another_folder(qwen3_folder, tmp_path):
    with pytest.raises(
        HFConfigError, match=r"hidden_size: config.json 48, model 64.*vocab_size: config.json 101, model 512"
    ):
        main(
            ["import", str(qwen3_folder), str(tmp_path / "dcp"), "--model.name", "qwen3_moe", "--model.flavor", "debug"]
        )
    with pytest.raises(HFConfigError, match="model_type = 'qwen3_moe' but --model.name is 'mixtral'"):
        main(["import", str(qwen3_folder), str(tmp_path / "dcp"), "--model.name", "mixtral"])
    assert not os.path.exists(tmp_path / "dcp")


def truncate(path, keep):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: keep(len(data))])


@pytest.mark.parametrize("fault", ["header", "data", "last_byte", "garbage", "missing", "no_config"])
def test_broken_folder_fails_naming_the_file(fault, qwen3_folder, tmp_path):
    bad = copy_folder(qwen3_folder, tmp_path / "bad")
    file = bad / "model.safetensors"
    if fault == "header":
        truncate(file, lambda n: 100)
    elif fault == "data":
        truncate(file, lambda n: n // 2)
    elif fault == "last_byte":
        truncate(file, lambda n: n - 1)
    elif fault == "garbage":
        file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    elif fault == "missing":
        os.remove(file)
    else:
        os.remove(bad / "config.json")
    r = cli(
        "import",
        str(bad),
        str(tmp_path / "dcp"),
        "--model.name",
        "qwen3_moe",
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(qwen3_folder),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    named = "config.json" if fault == "no_config" else ("bad" if fault == "missing" else "model.safetensors")
    assert named in r.stderr
    assert not os.path.exists(tmp_path / "dcp")


def test_sharded_folder_with_a_missing_shard(qwen3_folder, tmp_path):
    """A folder in several files whose index lists a shard that is absent, or a key the file lacks."""
    main(["import", str(qwen3_folder), str(tmp_path / "dcp")])
    main(
        [
            "export",
            str(tmp_path / "dcp"),
            str(tmp_path / "sharded"),
            "--model.name",
            "qwen3_moe",
            "--model.flavor",
            "hf",
            "--model.hf_config",
            str(qwen3_folder),
            "--max_shard_size",
            "30KB",
        ]
    )
    index = json.load(open(tmp_path / "sharded" / "model.safetensors.index.json"))
    shard = sorted(set(index["weight_map"].values()))[1]
    bad = copy_folder(tmp_path / "sharded", tmp_path / "bad")
    os.remove(bad / shard)
    with pytest.raises(CheckpointError, match=f"{shard}: listed in model.safetensors.index.json but missing"):
        main(["import", str(bad), str(tmp_path / "dcp2")])
    key = next(k for k, v in index["weight_map"].items() if v == shard)
    index["weight_map"][key] = sorted(set(index["weight_map"].values()))[0]
    bad2 = copy_folder(tmp_path / "sharded", tmp_path / "bad2")
    (bad2 / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"lists {key} in it"):
        main(["import", str(bad2), str(tmp_path / "dcp2")])
    assert not os.path.exists(tmp_path / "dcp2")


def test_export_checks(qwen3_folder, tmp_path):
    """export: storage checks of the DCP checkpoint, shapes before reading, no overwrite."""
    main(["import", str(qwen3_folder), str(tmp_path / "dcp")])
    with pytest.raises(CheckpointError, match=r"tok_embeddings.weight: checkpoint \[101, 48\], model \[512, 64\]"):
        main(
            [
                "export",
                str(tmp_path / "dcp"),
                str(tmp_path / "out"),
                "--model.name",
                "qwen3_moe",
                "--model.flavor",
                "debug",
            ]
        )
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        main(
            [
                "export",
                str(tmp_path / "dcp"),
                str(tmp_path / "used"),
                "--model.name",
                "qwen3_moe",
                "--model.flavor",
                "hf",
                "--model.hf_config",
                str(qwen3_folder),
            ]
        )
    assert os.listdir(tmp_path / "used") == ["keep.txt"]
    data = next(f for f in os.listdir(tmp_path / "dcp") if f.endswith(".distcp"))
    truncate(tmp_path / "dcp" / data, lambda n: n // 2)
    r = cli(
        "export",
        str(tmp_path / "dcp"),
        str(tmp_path / "out"),
        "--model.name",
        "qwen3_moe",
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(qwen3_folder),
    )
    assert r.returncode == 2 and f"data file {data} is truncated" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "out")
    r = cli(
        "export", str(tmp_path / "dcp"), str(tmp_path / "out"), "--model.name", "qwen3_moe", "--model.flavor", "nope"
    )
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --model.flavor 'nope': qwen3_moe has debug, 30B-A3B, 235B-A22B, hf"
    )


# ---------------------------------------------------------------- the trainer


TRAINER_CONFIG = dict(  # ep 2 and tp 2 divide it; vocab above the byte tokenizer's 258
    hidden_size=48,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=12,
    vocab_size=300,
    num_experts=4,
    num_experts_per_tok=3,
    moe_intermediate_size=20,
    intermediate_size=40,
    mlp_only_layers=[1],
    norm_topk_prob=True,
    attention_bias=True,
    tie_word_embeddings=True,
)


def test_trainer_imports_and_exports_hf(tmp_path):
    """`--model.flavor hf`, `--checkpoint.initial_load_in_hf`, then `--checkpoint.last_save_in_hf`
    on 2 ranks, attention on tp=2 and experts on ep=2 (DTensors everywhere, q/k norms under
    tp): with lr 0 the exported folder holds the imported tensors and opens in transformers."""
    from helpers import forked

    qwen3_folder = tmp_path / "hf"
    random_hf_model("qwen3_moe", TRAINER_CONFIG, qwen3_folder)
    codes, stdout, stderr = forked(
        2,
        "titan_fold.train",
        "--job.config_file",
        "debug_moe.toml",
        "--model.name",
        "qwen3_moe",
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(qwen3_folder),
        "--job.dump_folder",
        str(tmp_path / "out"),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(qwen3_folder),
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
        "--moe.aux_loss_coeff",
        "0",
    )
    assert codes == [0, 0], stderr[-4000:]
    out = tmp_path / "out" / "checkpoint" / "step-1"
    assert f"last checkpoint: {out} (Hugging Face safetensors: checkpoint.last_save_in_hf)" in stdout, stdout
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # no sharded/ copy
    before, after = read_hf_folder(str(qwen3_folder)), read_hf_folder(str(out))
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_folder).eval()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = tokens(300)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, hf(x).logits, rtol=0, atol=0)


def test_trainer_refuses_a_mismatched_hf_folder(tmp_path):
    """The trainer checks the HF folder's config.json before any process group: exit 2, one line."""
    qwen3_folder = tmp_path / "hf"
    random_hf_model("qwen3_moe", TRAINER_CONFIG, qwen3_folder)
    bad = copy_folder(qwen3_folder, tmp_path / "bad", {"num_experts_per_tok": 1})
    r = python_m(
        "titan_fold.train",
        "--job.config_file",
        "debug_qwen3_moe.toml",
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(qwen3_folder),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(bad),
        "--checkpoint.initial_load_in_hf",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "num_experts_per_tok: config.json 1, model 3" in errors[0]
    assert not os.path.exists(tmp_path / "run" / "checkpoint")


def test_trainer_qwen3_tp2_matches_one_rank(tmp_path):
    """qwen3_moe from an HF folder trains to the same losses and gradient norms on one rank and
    on tp 2 x ep 2 (the q/k norm weights see only their rank's heads: their gradients are
    summed over tp)."""
    from helpers import read_metrics, torchrun

    folder = tmp_path / "hf"
    random_hf_model("qwen3_moe", TRAINER_CONFIG, folder)
    common = (
        "--job.config_file",
        "debug_qwen3_moe.toml",
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(folder),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.interval",
        "1000",
        "--training.steps",
        "3",
        "--training.seq_len",
        "32",
        "--metrics.log_freq",
        "1",
    )
    runs = []
    for nproc, extra in (
        (1, ()),
        (2, ("--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2")),
    ):
        torchrun(nproc, "--job.dump_folder", str(tmp_path / f"run{nproc}"), *common[2:], *extra, config=common[1])
        runs.append(read_metrics(tmp_path / f"run{nproc}"))
    for one, two in zip(*runs, strict=True):
        assert one["step"] == two["step"]
        assert abs(one["loss"] - two["loss"]) <= 1e-4 * abs(one["loss"]), (one, two)
        assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-4 * abs(one["grad_norm"]), (one, two)
