"""Messages for mistyped input, importable without torch or torchtitan (the commands' fast paths)."""

import difflib
import re


def did_you_mean(word, choices, spell=str) -> str:
    """'; did you mean X?' for the choice closest to a mistyped word, or nothing."""
    if not isinstance(word, str):
        return ""
    match = difflib.get_close_matches(word, [c for c in choices if isinstance(c, str)], n=1)
    return f"; did you mean {spell(match[0])}?" if match else ""


# a KL-to-reference key (kl_coef, kl_to_reference, use_kl_loss, ref_model, ...): named apart
# from other unknown keys, for what users of other RL trainers expect
_REFERENCE_KEY = re.compile(r"(^|_)(kl|ref)(_|$)|reference")


def reference_key(name: str) -> str | None:
    """The line refusing `section.key` when it asks for a KL-to-reference term, else None."""
    if not _REFERENCE_KEY.search(name.rpartition(".")[2].lower()):
        return None
    return (
        f"{name}: titan_fold's policy objective (training.objective = 'policy') needs no reference model "
        'and has no KL-to-reference term (docs/rl.md, "The policy objective"); remove the key'
    )


def unknown_option(key: str, name: str, keys: list[str]) -> str:
    """The line for `--key` (as typed; name: its normalized `section.key`) that names no config key."""
    if refused := reference_key(name):
        return f"--{refused}"
    guess = did_you_mean(name, keys, lambda k: f"--{k}")
    return f"--{key}: unknown option" + (guess or " (the keys are the config file's, e.g. --training.steps 10)")


def option_names(args: list[str]):
    """-> (as typed, normalized `section.key`, its values) of each `--section.key [value ...]` in args."""
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--") or arg == "--help":
            continue
        key, eq, value = arg[2:].partition("=")
        values = [value] if eq else []
        while not eq and i < len(args) and not args[i].startswith("--"):
            values.append(args[i])
            i += 1
        yield key, key.replace("-", "_"), values
