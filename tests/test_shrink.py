"""`--debug.shrink`: every packaged config becomes a small run that passes every check on 2 and 4
ranks and trains on 2 CPU ranks, keeping the folding's shape where it fits (degrees worked out
by hand below), and says what it changed."""

import math
import os

import pytest
from helpers import forked, read_metrics

from titan_fold.common.config import parse_args
from titan_fold.common.values import PACKAGED_CONFIGS
from titan_fold.parallel.mesh import ATTENTION_DIMS, EXPERT_DIMS
from titan_fold.trainer.preflight import preflight
from titan_fold.trainer.shrink import shrink

CONFIGS = sorted(p.name for p in PACKAGED_CONFIGS.glob("*.toml"))
STEPS = 2


def shrunk(name: str, ranks: int, *args: str):
    config = parse_args(["--job.config_file", name, *args])
    return config, shrink(config, ranks)


def folding(layout) -> str:
    """The degrees above 1 of each mesh: "cp2 | ep2"."""

    def side(dims):
        return " ".join(f"{d}{getattr(layout, d)}" for d in dims if getattr(layout, d) > 1) or "-"

    return f"{side(ATTENTION_DIMS)} | {side(EXPERT_DIMS)}"


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", CONFIGS)
def test_shrunk_config_passes_every_check(name, ranks):
    config, _ = shrunk(name, ranks)
    preflight(config, ranks)  # raises on any refusal
    tr, par = config.training, config.parallelism
    assert config.model.flavor == "debug" and config.model.hf_assets_path == ""
    assert tr.seq_len <= 256 and tr.steps <= 4 and tr.global_batch_size == -1
    assert (tr.dtype, tr.mixed_precision_param) == ("float32", "float32")
    assert not config.compile.enable and config.activation_checkpoint.mode == "none"
    assert not config.checkpoint.enable and config.job.dump_folder.endswith("_shrunk")
    full = parse_args(["--job.config_file", name]).parallelism
    for key in (
        "context_parallel_degree",
        "tensor_parallel_degree",
        "expert_parallel_degree",
        "pipeline_parallel_degree",
    ):
        assert getattr(par, key) <= getattr(full, key), key


# (config, ranks) -> the shrunk run's two meshes, worked out from the config's degrees: cp, tp,
# ep, etp, pp, dp_replicate in turn, each as large as fits with those before it
SHAPES = {
    ("qwen3_30b_a3b.toml", 2): "cp2 | ep2",  # dp_shard 2 x cp 4 | ep 8 on 8 GPUs
    ("qwen3_30b_a3b.toml", 4): "cp4 | ep4",
    ("qwen2.toml", 4): "dp_shard2 tp2 | ep4",  # pp 4 x tp 2 | pp 4 x ep 4 on 64: ep before pp
    ("mixtral_8x22b.toml", 2): "tp2 | ep2",
    ("deepseek_v3_671b.toml", 4): "cp2 tp2 | ep4",  # pp 4 x cp 2 x tp 4 | pp 4 x ep 32 on 1024
    ("deepseek_v3_16b.toml", 2): "dp_shard2 | ep2",
    ("debug_moe.toml", 2): "dp_shard2 | edp2",
}


@pytest.mark.parametrize("name, ranks", list(SHAPES))
def test_shrunk_config_keeps_the_folding_where_it_fits(name, ranks):
    config, _ = shrunk(name, ranks)
    layout = preflight(config, ranks)
    assert folding(layout) == SHAPES[name, ranks]


def test_shrink_says_what_it_changed():
    _, lines = shrunk("qwen3_30b_a3b.toml", 2)
    assert lines == [
        "--debug.shrink: qwen3_30b_a3b.toml as a run of 4 steps on 2 ranks",
        "  model: flavor '30B-A3B' -> 'debug', hf_assets_path './assets/qwen3-30b-a3b' -> ''",
        "  training: seq_len 4096 -> 128, steps 2000 -> 4, global_batch_size 256 -> -1, "
        "mixed_precision_param 'bfloat16' -> 'float32', local_batch_size 1 -> 2",
        "  compile: enable True -> False",
        "  activation_checkpoint: mode 'selective' -> 'none'",
        "  checkpoint: enable True -> False",
        "  job: dump_folder './outputs/qwen3_30b_a3b' -> './outputs/qwen3_30b_a3b_shrunk'",
        "  parallelism: context_parallel_degree 4 -> 2, expert_parallel_degree 8 -> 2, "
        "data_parallel_shard_degree 2 -> -1, expert_data_parallel_degree 1 -> -1",
    ]


@pytest.mark.slow  # 2 forked ranks train
@pytest.mark.parametrize("name", CONFIGS)
def test_shrunk_config_trains_on_2_cpu_ranks(tmp_path, name):
    args = ["--job.config_file", name, "--debug.shrink", "--training.steps", str(STEPS)]
    codes, out, err = forked(2, "titan_fold.train", *args, "--job.dump_folder", str(tmp_path / "run"))
    assert codes == [0, 0], (codes, err[-4000:])
    assert err.count("--debug.shrink: ") == 1, err[-4000:]  # said once, by the first rank
    metrics = read_metrics(tmp_path / "run_shrunk")
    assert metrics[-1]["step"] == STEPS and all(math.isfinite(m["loss"]) for m in metrics), metrics
    assert not os.path.exists(tmp_path / "run")  # the full run's folder is left alone
