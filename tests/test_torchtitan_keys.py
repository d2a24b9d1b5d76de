"""Every key of torchtitan's JobConfig (and of titan_fold's extensions) is read, refused or
listed as of no effect (titan_fold/common/torchtitan_keys.py), and a read key's attribute is
accessed in the file the table names."""

import dataclasses
import os
import re
import typing

import pytest
import torchtitan
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


def test_read_keys_are_accessed_where_the_table_says():
    missing = []
    for key, where in torchtitan_keys.read_where().items():
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
    moe.expert_fp8; its Linear converters stay read."""
    with pytest.raises(ConfigError) as e:
        parse_args(["--model.converters", f"quantize.linear.float8,{converter}"])
    message = str(e.value)
    assert message.startswith("model.converters = ") and "moe.expert_fp8" in message and "\n" not in message
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
