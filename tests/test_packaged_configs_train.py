"""Every packaged config trains on the CPU, shrunk: its own keys, but a tiny model of its family
(the dry run's shrunk_config: the same experts, top-k and heads, few layers, tiny widths, as an
HF config.json under --model.flavor hf; chat SFT configs keep CHAT_SEQ_LEN), its degrees above 1 at 2 on gloo ranks with dp and edp
at 2 (pp > 1 with experts over edp > 1 and selective_ac_option "op", as qwen2.toml), the
byte-level tokenizer, compile off, a short sequence and batch, STEPS steps."""

import copy
import dataclasses
import json
import math

import pytest
from helpers import forked, read_metrics

from titan_fold.common.config import parse_args
from titan_fold.common.values import PACKAGED_CONFIGS
from titan_fold.dryrun import shrunk_config
from titan_fold.models.hf_config import hf_config
from titan_fold.trainer.preflight import model_args_from_config

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

STEPS = 2
CHAT_SEQ_LEN = 256
# the degrees a shrunk run keeps above 1 (at 2), in this order, while each side's product is at most 4
ATTENTION = (
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "tensor_parallel_degree",
    "data_parallel_replicate_degree",
)
EXPERT = ("expert_parallel_degree", "expert_tensor_parallel_degree")


def shrunk_layout(par) -> tuple[dict[str, int], int]:
    """Each degree above 1 at 2 while its side's product (the pipeline's on both) is at most 4,
    and the world size that leaves dp and edp at 2: the degrees, as keys, and the rank count."""
    out, attention = {}, 1
    for key in ATTENTION:
        out[key] = 2 if getattr(par, key) > 1 and attention * 2 <= 4 else 1
        attention *= out[key]
    expert = out["pipeline_parallel_degree"]
    for key in EXPERT:
        out[key] = 2 if getattr(par, key) > 1 and expert * 2 <= 4 else 1
        expert *= out[key]
    return out | {"data_parallel_shard_degree": -1, "expert_data_parallel_degree": -1}, 2 * max(attention, expert)


def shrunk_run(name: str, folder) -> tuple[int, list[str]]:
    """The rank count and the command-line overrides that shrink a packaged config onto CPU ranks."""
    config = parse_args(["--job.config_file", name])
    degrees, ranks = shrunk_layout(config.parallelism)
    for key, value in degrees.items():
        setattr(config.parallelism, key, value)
    _, model_args = model_args_from_config(config)
    small, args = shrunk_config(config, model_args, ranks)
    exported = copy.deepcopy(args)
    if config.training.dataset_format == "chat":
        # whole conversations, ChatML bytes: the dry run's few tokens would hold no assistant turn
        small.training.seq_len = exported.max_seq_len = CHAT_SEQ_LEN
    if config.model.name == "deepseek_v3":  # its config.json says sigmoid; --moe.score_func keeps the flavor's
        exported.moe = dataclasses.replace(exported.moe, score_func="sigmoid")
    (folder / "config.json").write_text(json.dumps(hf_config(config.model.name, exported)))
    # enough sequences for two pipeline micro-batches per stage, no more
    local = min(
        small.training.local_batch_size,
        2 * degrees["pipeline_parallel_degree"] * config.parallelism.pipeline_parallel_microbatch_size,
    )
    return ranks, [
        "--job.config_file",
        name,
        "--job.dump_folder",
        str(folder / "run"),
        *(a for key, value in degrees.items() for a in (f"--parallelism.{key}", str(value))),
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(folder / "config.json"),
        "--moe.score_func",
        args.moe.score_func,
        "--model.hf_assets_path",
        "",  # the byte-level tokenizer: the configs' folders are on the cluster
        "--compile.no-enable",  # inductor's CPU build of every block takes minutes
        "--training.seq_len",
        str(small.training.seq_len),
        "--training.local_batch_size",
        str(local),
        "--training.global_batch_size",
        "-1",
        "--training.steps",
        str(STEPS),
    ]


@pytest.mark.parametrize("name", sorted(p.name for p in PACKAGED_CONFIGS.glob("*.toml")))
def test_packaged_config_trains_shrunk(tmp_path, name):
    ranks, args = shrunk_run(name, tmp_path)
    codes, out, err = forked(ranks, "titan_fold.train", *args)
    assert codes == [0] * ranks, (codes, err[-4000:])
    metrics = read_metrics(tmp_path / "run")
    assert metrics[-1]["step"] == STEPS and all(math.isfinite(m["loss"]) for m in metrics), metrics
