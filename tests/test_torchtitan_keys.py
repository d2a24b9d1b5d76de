"""Every key of torchtitan's JobConfig (and of titan_fold's extensions) is read, refused or
listed as of no effect (titan_fold/common/torchtitan_keys.py), and a read key is read in the
file the table names: seen reading it in a traced run (a config whose sections record each
field read with the file of the code that reads it), or, for the keys that run does not read
(NOT_IN_THE_TRACED_RUN, each with when it is read), its attribute accessed in that file."""

import collections
import dataclasses
import json
import os
import re
import sys
import typing
from unittest import mock

import pytest
import torchtitan
from launcher import run_ranks
from torchtitan.config.job_config import JobConfig as TitanJobConfig

from titan_fold.common import torchtitan_keys
from titan_fold.common.config import ConfigError, JobConfig, parse_args
from titan_fold.common.rules import MOVED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.dirname(os.path.dirname(torchtitan.__file__))


def keys(cls: type, prefix: str = "") -> dict[str, object]:
    """Every `section.key` of a config class -> its default."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(keys(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    return out


def reads(path: str, key: str) -> bool:
    """Does the file access the key's last part as an attribute (or name it as a string)?"""
    leaf = key.rsplit(".", 1)[1]
    with open(path) as f:
        return re.search(rf"\.{leaf}\b|[\"']{leaf}[\"']", f.read()) is not None


def test_every_torchtitan_key_is_classified_once():
    read, refused = torchtitan_keys.read_where(), [r.key for r in torchtitan_keys.REFUSED]
    named = list(read) + refused + list(torchtitan_keys.NO_EFFECT)
    assert len(named) == len(set(named)), "a key classified twice"
    titan = keys(TitanJobConfig)
    assert sorted(set(titan) - set(named)) == [], "torchtitan keys the table does not classify"
    assert sorted(set(named) - set(titan)) == [], "the table names keys torchtitan's JobConfig lacks"
    for r in torchtitan_keys.REFUSED:  # refused at any value but torchtitan's default
        assert titan[r.key] == r.default, r.key


# the read keys the traced run (TRACED_ARGS, one rank) does not read -> when they are read
NOT_IN_THE_TRACED_RUN: dict[str, tuple[str, ...]] = {
    "while parsing, before the config exists": (
        "job.config_file",
        "job.custom_config_module",
        "experimental.custom_args_module",
        "model.tokenizer_path",
    ),
    "with profiling.enable_profiling or enable_memory_snapshot (a GPU's profiler)": (
        "profiling.save_traces_folder",
        "profiling.profile_freq",
        "profiling.profiler_active",
        "profiling.profiler_warmup",
        "profiling.save_memory_snapshot_folder",
    ),
    "when stdout is a terminal": ("metrics.disable_color_printing",),
    "with compile.enable": ("compile.components", "compile.backend"),
    "with FSDP or tensor parallelism (more than one rank)": (
        "parallelism.fsdp_reshard_after_forward",
        "parallelism.disable_loss_parallel",
    ),
    "with pipeline parallelism": (
        "parallelism.module_fqns_per_model_part",
        "parallelism.pipeline_parallel_first_stage_less_layers",
        "parallelism.pipeline_parallel_last_stage_less_layers",
        "parallelism.pipeline_parallel_layers_per_stage",
        "parallelism.pipeline_parallel_schedule",
        "parallelism.pipeline_parallel_schedule_csv",
        "parallelism.pipeline_parallel_microbatch_size",
    ),
    "with checkpoint.enable_ft_dataloader_checkpoints' fault tolerance": (
        "checkpoint.enable_ft_dataloader_checkpoints",
    ),
    "with other activation_checkpoint modes and options": (
        "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
        "activation_checkpoint.memory_budget",
        "activation_checkpoint.visualize_memory_budget_pareto",
    ),
    "with model.converters' Linear converters (torchao, an sm89+ GPU)": (
        "quantize.linear.float8.enable_fsdp_float8_all_gather",
        "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
        "quantize.linear.float8.recipe_name",
        "quantize.linear.float8.filter_fqns",
        "quantize.linear.float8.emulate",
        "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
        "quantize.linear.mx.recipe_name",
        "quantize.linear.mx.filter_fqns",
    ),
    "with debug.deterministic": ("debug.deterministic_warn_only",),
}
TRACED_ARGS = (
    "--job.config_file",
    "debug_moe.toml",
    "--training.steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "1",
    "--activation_checkpoint.mode",
    "selective",
    "--metrics.enable_tensorboard",
)


def reader(frame) -> str | None:
    """The first file of titan_fold or of a library (not torch's, not the standard library's)
    on the call stack from `frame` up: titan_fold/... or a path relative to site-packages."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(os.path.join(ROOT, "titan_fold") + os.sep):
            return os.path.relpath(path, ROOT)
        if path.startswith(SITE + os.sep) and not path.startswith(os.path.join(SITE, "torch") + os.sep):
            return os.path.relpath(path, SITE)
        frame = frame.f_back
    return None


def record_reads(section, reads: dict[str, set[str]], prefix: str = "") -> None:
    """Each field of `section` (and of its subsections) read from now on adds its reader to
    reads["section.key"]: the section's class becomes a subclass that records them."""
    fields = frozenset(f.name for f in dataclasses.fields(section))
    for name in fields:
        value = getattr(section, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            record_reads(value, reads, f"{prefix}{name}.")

    def __getattribute__(self, name):
        if name in fields and (where := reader(sys._getframe(1))) is not None:
            reads[prefix + name].add(where)
        return object.__getattribute__(self, name)

    cls = type(section)
    section.__class__ = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__})


def traced_worker(rank: int, port: int, out_dir: str) -> None:
    """The trainer's main (preflight, lock, build, two steps, saves) on one rank with a config
    that records its reads -> out_dir/reads.json."""
    from titan_fold.trainer import fold_trainer

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config = parse_args([*TRACED_ARGS, "--job.dump_folder", os.path.join(out_dir, "run")])
    reads: dict[str, set[str]] = collections.defaultdict(set)
    record_reads(config, reads)
    with mock.patch.object(fold_trainer, "parse_args", lambda args: config):
        assert fold_trainer.main([]) == 0
    with open(os.path.join(out_dir, "reads.json"), "w") as f:
        json.dump({key: sorted(files) for key, files in reads.items()}, f)


@pytest.fixture(scope="module")
def traced_reads(tmp_path_factory) -> dict[str, list[str]]:
    out = tmp_path_factory.mktemp("traced")
    run_ranks(traced_worker, 1, out)
    with open(out / "reads.json") as f:
        return json.load(f)


@pytest.mark.slow
def test_read_keys_are_read_where_the_table_says(traced_reads):
    """A key the traced run reads is read there by the file the table names; the keys it does
    not read are exactly NOT_IN_THE_TRACED_RUN's."""
    table = torchtitan_keys.read_where()
    wrong = {key: (where, traced_reads[key]) for key, where in table.items() if key in traced_reads}
    assert {key: seen for key, seen in wrong.items() if seen[0] not in seen[1]} == {}
    untraced = sorted(key for keys in NOT_IN_THE_TRACED_RUN.values() for key in keys)
    assert sorted(key for key in table if key not in traced_reads) == untraced


def test_untraced_read_keys_are_accessed_where_the_table_says():
    """The keys the traced run does not read: the table's file accesses the key's attribute."""
    table, missing = torchtitan_keys.read_where(), []
    for key in (key for keys in NOT_IN_THE_TRACED_RUN.values() for key in keys):
        where = table[key]
        base = ROOT if where.startswith("titan_fold/") else SITE
        if not reads(os.path.join(base, where), key):
            missing.append(f"{key} in {where}")
    assert missing == []


def imported(path: str) -> set[str]:
    """The torchtitan files a file imports (absolute or relative imports), as paths."""
    with open(path) as f:
        text = f.read()
    package = os.path.relpath(os.path.dirname(path), SITE).replace(os.sep, ".")
    found = set()
    pattern = r"^[^\S\n]*from (\.*[\w.]*) import (?:\(([^)]*)\)|([^\n]*))"
    for module, wrapped, line in re.findall(pattern, text, re.M):
        if module.startswith("."):
            dots = len(module) - len(module.lstrip("."))
            module = ".".join([*package.split(".")[: len(package.split(".")) - dots + 1], module.lstrip(".")])
            module = module.rstrip(".")
        names = [n.split(" as ")[0].strip() for n in (wrapped or line).split("#")[0].split(",")]
        found |= {module, *(f"{module}.{n}" for n in names if n)}
    found.update(re.findall(r"^[^\S\n]*import ([\w.]+)", text, re.M))
    paths = set()
    for module in found:
        if module.startswith("torchtitan"):
            base = os.path.join(SITE, *module.split("."))
            paths.update(p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.exists(p))
    return paths


def test_torchtitan_files_named_are_reached_from_titan_fold():
    """A key read by a torchtitan file counts only while titan_fold runs that file: imported by
    titan_fold, or by a torchtitan module it runs (so a trainer that stops running torchtitan's
    Trainer must reclassify the keys only torchtitan/train.py reads)."""
    todo = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "titan_fold")):
        for name in files:
            if name.endswith(".py"):
                todo |= imported(os.path.join(folder, name))
    reached = set()
    while todo:
        path = todo.pop()
        reached.add(path)
        todo |= imported(path) - reached
    named = {where for where in torchtitan_keys.READ if where.startswith("torchtitan/")}
    assert sorted(w for w in named if os.path.join(SITE, w) not in reached) == []


def test_titan_fold_keys_are_read_by_titan_fold():
    ours = sorted(set(keys(JobConfig)) - set(keys(TitanJobConfig)))
    sources = []
    for folder, _, files in os.walk(os.path.join(ROOT, "titan_fold")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    sources.append(f.read())
    text = "\n".join(sources)
    moved = {f"{m.section}.{m.old}" for m in MOVED}  # read by rules.move_keys, by name
    unread = [k for k in ours if k not in moved and not re.search(rf"\.{k.rsplit('.', 1)[1]}\b", text)]
    assert ours and unread == []


# a value other than the default for each refused key
SET = {
    "parallelism.expert_parallel_comm_backend": ["deepep"],
    "parallelism.enable_async_tensor_parallel": [],
    "parallelism.context_parallel_rotate_method": ["alltoall"],
    "parallelism.context_parallel_load_balancer": ["ptrr"],
    "training.enable_cpu_offload": [],
    "fault_tolerance.enable": [],
    "quantize.grouped_mm.float8.fqns": ["experts"],
    "quantize.grouped_mm.mx.fqns": ["experts"],
    "validation.enable": [],
    "memory_estimation.enable": [],
    "debug.moe_force_load_balance": [],
    "job.print_config": [],
    "job.save_config_file": ["config.toml"],
}


@pytest.mark.parametrize("refused", torchtitan_keys.REFUSED, ids=lambda r: r.key)
def test_refused_key_is_one_line_naming_it(refused):
    with pytest.raises(ConfigError) as e:
        parse_args([f"--{refused.key}", *SET[refused.key]])
    message = str(e.value)
    assert message.startswith(f"{refused.key} = ") and refused.instead in message and "\n" not in message
    if isinstance(refused.default, str):  # a flag's or an unset key's default is the bare command's
        parse_args([f"--{refused.key}", refused.default])


@pytest.mark.parametrize("converter", torchtitan_keys.REFUSED_CONVERTERS)
def test_refused_converter_is_one_line_naming_the_route(converter):
    """torchtitan's grouped-GEMM converters are refused by name in model.converters, naming
    moe.expert_kernels = "fp8"; its Linear converters stay read."""
    with pytest.raises(ConfigError) as e:
        parse_args(["--model.converters", f"quantize.linear.float8,{converter}"])
    message = str(e.value)
    assert message.startswith("model.converters = ") and "moe.expert_kernels = 'fp8'" in message and "\n" not in message
    assert repr(converter) in message
    assert parse_args(["--model.converters", "quantize.linear.float8"]).model.converters == ["quantize.linear.float8"]


def test_fault_tolerance_keys_are_refused_or_inert():
    """fault_tolerance.enable is refused; every other fault_tolerance key torchtitan reads only
    with it (its FTManager and metrics logger), so each is listed as of no effect for that reason."""
    refused = {r.key for r in torchtitan_keys.REFUSED}
    ft = [k for k in keys(TitanJobConfig) if k.startswith("fault_tolerance.")]
    assert "fault_tolerance.enable" in refused
    inert = {k: why for k, why in torchtitan_keys.NO_EFFECT.items() if k.startswith("fault_tolerance.")}
    assert sorted(inert) == sorted(k for k in ft if k != "fault_tolerance.enable")
    assert all("fault_tolerance.enable, which is refused" in why for why in inert.values())
