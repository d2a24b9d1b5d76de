"""Input that used to escape the checks is one line `error: ...` and exit code 2, in a real run
and in a dry run alike: a numeric key out of its range (ranges.RANGES), a config.json field of
the wrong type or range (hf_config.HF_FIELDS), a config path that is a folder, a local dataset
that cannot give text, and, in a real run, a missing tokenizer folder (a dry run warns: the
folder may be on the cluster only) and a Hub dataset that cannot be read."""

import dataclasses
import json
import operator
import re
import shutil
import typing
from pathlib import Path

import pytest
from helpers import forked

from titan_fold.common.config import JobConfig, parse_args
from titan_fold.common.ranges import RANGES
from titan_fold.models.hf_config import HF_FIELDS, hf_config
from titan_fold.trainer.preflight import model_args_from_config

ROOT = Path(__file__).parent.parent
RULES = {r.key: r.rule for r in RANGES}
# numeric keys whose every value is valid
UNBOUNDED = {"debug.seed"}


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def both_runs(tmp_path, *args: str) -> list[tuple[int, str]]:
    """(exit code, stderr) of a real run on one rank and of a dry run at 2 ranks."""
    args = ("--training.steps", "1", *args)
    (real,), _, real_err = forked(1, "titan_fold.train", "--job.dump_folder", str(tmp_path / "real"), *args)
    (dry,), _, dry_err = forked(
        0,
        "titan_fold.train",
        "--job.dump_folder",
        str(tmp_path / "dry"),
        *args,
        "--comm.mode",
        "fake_backend",
        "--comm.no-dry_run_collectives",
        env={"NGPU": "2"},
    )
    return [(real, real_err), (dry, dry_err)]


def assert_one_line(runs: list[tuple[int, str]], pattern: str) -> None:
    for code, err in runs:
        lines = error_lines(err)
        assert code == 2 and len(lines) == 1, (code, err[-3000:])
        assert re.fullmatch(pattern, lines[0]), (lines[0], pattern)


def numeric_keys(cls=JobConfig, prefix="") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += numeric_keys(hint, f"{prefix}{f.name}.")
        elif typing.get_origin(hint) is not typing.Literal and {int, float} & {hint, *typing.get_args(hint)}:
            keys.append(prefix + f.name)
    return keys


def test_every_numeric_key_has_a_range():
    assert sorted(set(numeric_keys()) - UNBOUNDED - set(RULES)) == []
    config = JobConfig()
    for key in RULES:  # each names a key of the config
        section, _, name = key.rpartition(".")
        assert dataclasses.is_dataclass(operator.attrgetter(section)(config)) and hasattr(
            operator.attrgetter(section)(config), name
        ), key


def test_configuration_doc_lists_every_range():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f"| `{key}` | {rule} |" for key, rule in RULES.items() if f"| `{key}` | {rule} |" not in doc]
    assert not missing, missing


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "titan_fold" / "train_configs").glob("*.toml")))
def test_packaged_configs_are_in_range(name):
    parse_args(["--job.config_file", name])


@pytest.mark.parametrize(
    "key, value",
    [
        pytest.param("optimizer.lr", "-0.001", id="negative-lr"),
        pytest.param("optimizer.beta1", "1.0", id="beta1-one"),
        pytest.param("optimizer.beta2", "-0.5", id="beta2-negative"),
        pytest.param("optimizer.eps", "-1e-8", id="negative-eps"),
        pytest.param("optimizer.weight_decay", "-0.1", id="negative-decay"),
        pytest.param("optimizer.muon_ns_steps", "0", id="no-newton-schulz-steps"),
        pytest.param("lr_scheduler.warmup_steps", "-3", id="negative-warmup"),
        pytest.param("lr_scheduler.total_steps", "0", id="zero-total-steps"),
        pytest.param("lr_scheduler.decay_ratio", "1.5", id="decay-ratio-above-one"),
        pytest.param("lr_scheduler.min_lr_factor", "-0.1", id="negative-min-lr"),
        pytest.param("training.steps", "-1", id="negative-steps"),
        pytest.param("training.max_norm", "-1.0", id="negative-max-norm"),
        pytest.param("training.global_batch_size", "-2", id="global-batch-minus-two"),
        pytest.param("training.gc_freq", "0", id="zero-gc-freq"),
        pytest.param("checkpoint.interval", "0", id="zero-interval"),
        pytest.param("checkpoint.keep_latest_k", "1", id="keep-one"),
        pytest.param("metrics.log_freq", "-5", id="negative-log-freq"),
        pytest.param("parallelism.pipeline_parallel_microbatch_size", "0", id="zero-microbatch"),
        pytest.param("parallelism.expert_data_parallel_degree", "-2", id="edp-minus-two"),
        pytest.param("parallelism.tensor_parallel_degree", "0", id="zero-tp"),
        pytest.param("activation_checkpoint.memory_budget", "2.0", id="memory-budget-above-one"),
        pytest.param("activation_checkpoint.selective_ac_option", "-1", id="negative-sac-frequency"),
        pytest.param("activation_checkpoint.selective_ac_option", "ops", id="sac-option-typo"),
        pytest.param("comm.train_timeout_seconds", "0", id="zero-timeout"),
        pytest.param("moe.capacity_factor", "-1.25", id="negative-capacity"),
        pytest.param("moe.z_loss_coeff", "-0.001", id="negative-z-loss"),
        pytest.param("moe.num_groups", "0", id="zero-groups"),
        pytest.param("mtp.loss_scaling_factor", "-0.1", id="negative-mtp-scale"),
    ],
)
def test_out_of_range_key_is_one_line_in_both_runs(tmp_path, key, value):
    runs = both_runs(tmp_path, "--job.config_file", "debug_moe.toml", f"--{key}", value)
    assert_one_line(runs, rf"error: {re.escape(key)} = \S+: must be {re.escape(RULES[key])}")


def test_grouped_gemm_converter_is_one_line_in_both_runs(tmp_path):
    """torchtitan's FP8 grouped-GEMM converter, a second FP8 route for the experts, is refused
    while the config is read: one line naming moe.expert_kernels, before any process group."""
    runs = both_runs(
        tmp_path, "--job.config_file", "debug_moe.toml", "--model.converters", "quantize.grouped_mm.float8"
    )
    assert_one_line(
        runs, r"error: model\.converters = \['quantize\.grouped_mm\.float8'\]: .*moe\.expert_kernels = 'fp8'.*"
    )
    assert not (tmp_path / "real").exists()


@pytest.fixture(scope="module")
def debug_hf_config() -> dict:
    config = parse_args(["--job.config_file", "debug_moe.toml", "--model.name", "qwen3_moe"])
    return hf_config("qwen3_moe", model_args_from_config(config)[1])


HF_RULES = {key: rule for key, rule, _ in HF_FIELDS}


@pytest.mark.parametrize(
    "field, value",
    [
        pytest.param("hidden_size", "2048", id="hidden-size-string"),
        pytest.param("hidden_size", 64.0, id="hidden-size-float"),
        pytest.param("num_experts", -8, id="negative-experts"),
        pytest.param("num_experts_per_tok", True, id="top-k-bool"),
        pytest.param("num_hidden_layers", 0, id="zero-layers"),
        pytest.param("vocab_size", [512], id="vocab-list"),
        pytest.param("moe_intermediate_size", -64, id="negative-expert-width"),
        pytest.param("rms_norm_eps", "1e-6", id="eps-string"),
        pytest.param("rms_norm_eps", -1e-6, id="negative-eps"),
        pytest.param("rope_theta", 0, id="zero-theta"),
        pytest.param("norm_topk_prob", "yes", id="bool-string"),
        pytest.param("router_aux_loss_coef", -0.01, id="negative-aux-coef"),
    ],
)
def test_bad_hf_config_field_is_one_line(tmp_path, debug_hf_config, field, value):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(debug_hf_config | {field: value}))
    runs = both_runs(
        tmp_path,
        "--job.config_file",
        "debug_moe.toml",
        "--model.name",
        "qwen3_moe",
        "--model.flavor",
        "hf",
        "--model.hf_config",
        str(folder),
    )
    where = re.escape(str(folder / "config.json"))
    assert_one_line(runs, rf"error: {where}: {field} = {re.escape(repr(value))}: must be {re.escape(HF_RULES[field])}")


def test_config_file_that_is_a_folder_is_one_line(tmp_path):
    assert_one_line(
        both_runs(tmp_path, "--job.config_file", str(tmp_path)),
        rf"error: job.config_file: '{re.escape(str(tmp_path))}' is a folder, not a TOML file",
    )


def test_missing_tokenizer_folder_fails_a_real_run_in_one_line(tmp_path):
    # qwen3_30b_a3b.toml's hf_assets_path as shipped: the folder is on the cluster
    args = (
        "--job.config_file",
        "debug_moe.toml",
        "--model.hf_assets_path",
        "./assets/qwen3-30b-a3b",
        "--training.steps",
        "1",
        "--job.dump_folder",
        str(tmp_path / "real"),
    )
    codes, _, err = forked(2, "titan_fold.train", *args)
    lines = error_lines(err)
    assert codes == [2, 2] and lines == [
        "error: model.hf_assets_path = './assets/qwen3-30b-a3b': no such folder (unset it for the byte-level tokenizer)"
    ], (codes, err[-3000:])
    assert "Traceback" not in err


def test_missing_tokenizer_folder_is_a_warning_in_a_dry_run(tmp_path):
    (code,), out, err = forked(
        0,
        "titan_fold.train",
        "--job.config_file",
        "debug_moe.toml",
        "--model.hf_assets_path",
        "./assets/qwen3-30b-a3b",
        "--job.dump_folder",
        str(tmp_path),
        "--comm.mode",
        "fake_backend",
        "--comm.no-dry_run_collectives",
        env={"NGPU": "2"},
    )
    assert code == 0 and not error_lines(err), (code, err[-3000:])
    assert "not checked here: model.hf_assets_path = './assets/qwen3-30b-a3b': no such folder" in out + err


def bad_dataset(folder, name: str) -> str:
    """A local training.dataset_path that cannot give text: the path."""
    folder.mkdir()
    files = {
        "malformed_record": ("bad.jsonl", '{"text": "one"}\n{"text": "two"\n'),
        "number_record": ("mixed.jsonl", '{"text": "one"}\n{"text": 5}\n'),
        "no_text_column": ("table.csv", "a,b\n1,2\n"),
        "no_data_files": ("README", "not data\n"),
    }
    file, text = files[name]
    (folder / file).write_text(text)
    return str(folder if name == "no_data_files" else folder / file)


@pytest.mark.parametrize(
    "name, pattern",
    [
        pytest.param("missing", "'PATH' does not exist", id="missing"),
        pytest.param("unset", None, id="unset"),
        pytest.param(
            "malformed_record",
            r"'PATH': cannot be read \(ArrowInvalid: JSON parse error: .* in row 1\)",
            id="malformed-record",
        ),
        pytest.param(
            "number_record", r"'PATH': record 1 has a 'text' of type int \('5'\), not a string", id="number-record"
        ),
        pytest.param("no_text_column", r"'PATH' has no 'text' column \(columns: \['a', 'b'\]\)", id="no-text-column"),
        pytest.param(
            "no_data_files",
            r"'PATH': cannot be read \(DataFilesNotFoundError: No \(supported\) data files "
            r"found in PATH\)",
            id="no-data-files",
        ),
    ],
)
def test_bad_dataset_is_one_line_in_both_runs(tmp_path, name, pattern):
    if name == "unset":
        args, pattern = (
            (),
            re.escape(
                "error: training.dataset = 'hf' needs training.dataset_path (a local file, folder or HF hub name)"
            ),
        )
    else:
        path = str(tmp_path / "data" / "corpus.jsonl") if name == "missing" else bad_dataset(tmp_path / "data", name)
        args, pattern = (
            ("--training.dataset_path", path),
            "error: training.dataset_path = " + pattern.replace("PATH", re.escape(path)),
        )
    assert_one_line(
        both_runs(tmp_path, "--job.config_file", "debug_moe.toml", "--training.dataset", "hf", *args), pattern
    )
    assert not (tmp_path / "real").exists()  # refused before the dump folder


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hub", "no_tokens"])
def test_dataset_found_bad_by_a_real_run_is_one_line(tmp_path, name):
    """A Hub name is read as the data loader is built; a text file of empty lines found empty
    at the first step (lengths are found lazily)."""
    if name == "hub":
        path, line = (
            "no-owner/no-such-dataset",
            (
                "error: training.dataset_path = 'no-owner/no-such-dataset': no such "
                "local file or folder, nor a readable Hub dataset ("
            ),
        )
    else:
        path = tmp_path / "empty.txt"
        path.write_text("\n\n")
        path, line = str(path), f"error: training.dataset_path: hf:{path} holds no tokens"
    codes, _, err = forked(
        2,
        "titan_fold.train",
        "--job.config_file",
        "debug_moe.toml",
        "--training.dataset",
        "hf",
        "--training.dataset_path",
        path,
        "--training.steps",
        "1",
        "--job.dump_folder",
        str(tmp_path / "real"),
        env={"HF_HUB_OFFLINE": "1"},
    )
    lines = error_lines(err)
    assert codes == [2, 2] and len(lines) == 1 and lines[0].startswith(line), (codes, err[-3000:])
    assert "Traceback" not in err


def test_hub_dataset_is_a_warning_in_a_dry_run(tmp_path):
    (code,), out, err = forked(
        0,
        "titan_fold.train",
        "--job.config_file",
        "debug_moe.toml",
        "--training.dataset",
        "hf",
        "--training.dataset_path",
        "no-owner/no-such-dataset",
        "--job.dump_folder",
        str(tmp_path),
        "--comm.mode",
        "fake_backend",
        "--comm.no-dry_run_collectives",
        env={"NGPU": "2", "HF_HUB_OFFLINE": "1"},
    )
    assert code == 0 and not error_lines(err), (code, err[-3000:])
    assert (
        "not checked here: training.dataset_path = 'no-owner/no-such-dataset': a Hub dataset, read by a real run "
        "as it builds its data loader"
    ) in out + err


@pytest.mark.slow
def test_resume_with_fewer_steps_than_the_checkpoint_is_one_line(tmp_path):
    """training.steps counts the run's steps from its start (torchtitan's and Megatron-LM's
    rule): a checkpoint at step 2 resumed with training.steps 1 leaves nothing to train and
    lies past the end of the lr schedule, refused before any work; the planted bug this
    catches is the schedule evaluated past its end (an AssertionError on every rank)."""
    small = ("--training.local_batch_size", "1", "--training.global_batch_size", "-1", "--training.seq_len", "32")
    args = ("--job.config_file", "debug_moe.toml", "--checkpoint.enable", *small)
    (code,), _, err = forked(
        1,
        "titan_fold.train",
        *args,
        "--job.dump_folder",
        str(tmp_path / "real"),
        "--training.steps",
        "2",
        "--checkpoint.interval",
        "2",
    )
    assert code == 0, err[-3000:]
    shutil.copytree(tmp_path / "real", tmp_path / "dry")
    runs = both_runs(tmp_path, *args)  # --training.steps 1
    step = re.escape(str(tmp_path / "FOLDER" / "checkpoint" / "step-2"))
    for (code, err), folder in zip(runs, ("real", "dry"), strict=True):
        assert_one_line(
            [(code, err)],
            rf"error: training.steps = 1, but {step.replace('FOLDER', folder)} is at step 2: .*"
            r"--training.steps 3 or more to train on, or another job.dump_folder to start afresh",
        )
