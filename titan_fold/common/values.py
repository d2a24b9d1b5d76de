"""Job config values against their fields' types, importable without torch or torchtitan: the
checks of TOML values and `--section.key value` overrides (common/config.py), also run from the
keys and types stored in titan_fold/train_keys.txt before the training command's heavy imports."""

import math
import os
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from titan_fold.common.errors import UserError
from titan_fold.common.hints import did_you_mean, option_names, unknown_option
from titan_fold.common.packaged_configs import PACKAGED_CONFIGS, names


class ConfigError(UserError, ValueError):
    """A job config value breaks a rule; the message names the key and the rule."""


def packaged_configs() -> str:
    return ", ".join(names())


def resolve_config_file(path: str) -> str:
    """A name not found from the working directory is looked up in the packaged configs."""
    if os.path.isdir(path):
        raise ConfigError(f"job.config_file: '{path}' is a folder, not a TOML file")
    if os.path.exists(path):
        return path
    packaged = PACKAGED_CONFIGS / path
    if os.sep not in path and packaged.exists():
        return str(packaged)
    raise ConfigError(f"job.config_file: '{path}' does not exist (packaged configs: {packaged_configs()})")


def _resolve_config_arg(args: list[str]) -> tuple[list[str], str | None]:
    args, path = list(args), None
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            if eq:
                path = resolve_config_file(value)
                args[i] = f"{key}={path}"
            elif i + 1 < len(args):
                path = args[i + 1] = resolve_config_file(args[i + 1])
    return args, path


def no_config_file() -> str:
    """The line for a command that names no config file (nor a titan_fold model family)."""
    return f"no --job.config_file: name the job's config file (packaged: {packaged_configs()})"


_INF_ALLOWED = {"training.max_norm"}


def _type_name(hint) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + str(list(typing.get_args(hint)))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if {int, float} <= set(typing.get_args(hint)):
            return _type_name(float)
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    return {bool: "a bool (true/false)", int: "an integer", float: "a finite number", str: "a string"}.get(
        hint, str(hint)
    )


def _fits(hint, value, name: str) -> bool:
    """Does a TOML value have the field's type? No coercion: "false" is not a bool, 4.7 not an int."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(a, value, name) for a in typing.get_args(hint) if a is not type(None))
    if origin is list:
        return isinstance(value, list) and all(_fits(typing.get_args(hint)[0], v, name) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return math.isfinite(value) or (name in _INF_ALLOWED and not math.isnan(value))
    if hint is str:
        return isinstance(value, str)
    return True  # a type no TOML value maps to; torchtitan checks it


def _choices(hint) -> list:
    """The values a Literal field (or one that may be unset) takes."""
    if typing.get_origin(hint) is Literal:
        return list(typing.get_args(hint))
    return [c for a in typing.get_args(hint) if typing.get_origin(a) is Literal for c in typing.get_args(a)]


def check_value(name: str, hint, value) -> None:
    if value is None and type(None) in typing.get_args(hint):
        return
    if not _fits(hint, value, name):
        raise ConfigError(f"{name} = {value!r}: must be {_type_name(hint)}{did_you_mean(value, _choices(hint), repr)}")


def _takes_list(hint) -> bool:
    return any(typing.get_origin(a) is list for a in (hint, *typing.get_args(hint)))


_INT = re.compile(r"[+-]?\d+")


def _parse_cli_value(name: str, hint, text: str):
    """A CLI string as the value of the field's type, by the same rules as TOML values."""
    candidates = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if typing.get_origin(hint) is Literal:
        candidates = [hint]
    if text == "None" and type(None) in typing.get_args(hint):
        return None
    for a in candidates:
        if typing.get_origin(a) is Literal:
            if text in typing.get_args(a):
                return text
        elif a is int and _INT.fullmatch(text):
            return int(text)
        elif a is float:
            try:
                return float(text)
            except ValueError:
                pass
        elif a is str or typing.get_origin(a) is list:
            return text
    raise ConfigError(f"--{name} {text}: must be {_type_name(hint)}{did_you_mean(text, _choices(hint), repr)}")


# a bool on the command line, in any case: as TOML writes it; `none` unsets a key that may be unset
BOOL_WORDS = {"true": True, "false": False, "none": None}


def _bool_key(name: str, field: Callable[[str], Any]) -> tuple[str, bool, bool] | None:
    """A bool key as named on the command line: (its `section.key`, whether it may be unset,
    whether the name negates it: tyro's `--section.no-key`), or None for any other key."""
    hint = field(name)
    if hint is bool or (
        typing.get_origin(hint) in (typing.Union, types.UnionType) and set(typing.get_args(hint)) == {bool, type(None)}
    ):
        return name, hint is not bool, False
    section, _, last = name.rpartition(".")
    if hint is None and last.startswith("no_") and field(f"{section}.{last[3:]}") is bool:
        return f"{section}.{last[3:]}", False, True
    return None


def _bool_words(may_be_unset: bool) -> str:
    return "true, false or none" if may_be_unset else "true or false"


def check_cli(args: list[str], field: Callable[[str], Any], keys: Callable[[], list[str]]) -> set[str]:
    """Every `--section.key [value]` names a field and its value has the field's type, so a
    bad override is one line here instead of tyro's box (or a coercion); -> the keys named.
    A bool takes true / false in any case (none where it may be unset), or stands alone for
    true (`tyro_args` spells it for tyro). field(key): the key's type hint or None; keys():
    every key, for the hint."""
    named = set()
    for key, name, values in option_names(args):
        if (found := _bool_key(name, field)) is not None:
            name, may_be_unset, _ = found
            named.add(name)
            if len(values) > 1:
                raise ConfigError(f"--{key}: needs one value ({_bool_words(may_be_unset)}), got {len(values)}")
            word = values[0].lower() if values else "true"
            if word not in BOOL_WORDS or (BOOL_WORDS[word] is None and not may_be_unset):
                raise ConfigError(f"--{key} {values[0]}: must be {_bool_words(may_be_unset)} (or alone: true)")
            continue
        hint = field(name)
        if hint is None:
            raise ConfigError(unknown_option(key, name, keys()))
        named.add(name)
        if len(values) != 1 and not _takes_list(hint):
            raise ConfigError(f"--{key}: needs one value ({_type_name(hint)}), got {len(values)}")
        if _takes_list(hint):
            element = next(
                typing.get_args(a)[0] for a in (hint, *typing.get_args(hint)) if typing.get_origin(a) is list
            )
            hint = element if not _takes_list(element) else str
        for v in values:
            check_value(name, hint, _parse_cli_value(name, hint, v))
    return named


def tyro_args(args: list[str], field: Callable[[str], Any]) -> list[str]:
    """`args` (checked by check_cli) as tyro reads them: a bool key becomes tyro's flag
    (`--section.key` or `--section.no-key`) and a key that may be unset `--section.key
    True|False|None`, whatever case its value was written in or whether it stood alone."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        i += 1
        key, eq, text = arg[2:].partition("=")
        found = _bool_key(key.replace("-", "_"), field) if arg.startswith("--") else None
        if found is None:
            out.append(arg)
            continue
        name, may_be_unset, negated = found
        if not eq and i < len(args) and not args[i].startswith("--"):
            text, eq = args[i], "="
            i += 1
        value = BOOL_WORDS[text.lower()] if eq else True
        if may_be_unset:
            out += [f"--{name}", str(value)]
        else:
            section, _, last = name.rpartition(".")
            out.append(f"--{section}.{last}" if value != negated else f"--{section}.no-{last}")
    return out


def hint_text(hint) -> str:
    """A field's type hint as text that `parse_hint` reads back (int, float | None, Literal['a', 'b'], list[str])."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return f"Literal[{', '.join(repr(a) for a in typing.get_args(hint))}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(hint_text(a) for a in typing.get_args(hint))
    if origin is list:
        return f"list[{hint_text(typing.get_args(hint)[0])}]"
    if hint is type(None):
        return "None"
    return hint.__name__


def parse_hint(text: str):
    hint = eval(
        text, {"Literal": Literal, "None": None, "int": int, "float": float, "str": str, "bool": bool, "list": list}
    )
    return type(None) if hint is None else hint
