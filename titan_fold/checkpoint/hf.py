"""Convert between Hugging Face safetensors folders and DCP checkpoints on one process.

    python -m titan_fold.hf import HF_FOLDER DCP_FOLDER
    python -m titan_fold.hf import HF_FOLDER DCP_FOLDER --model.name qwen2_moe --model.flavor 57B-A14B
    python -m titan_fold.hf import /models/DeepSeek-V3 DCP_FOLDER [--mtp.num_layers 1]   (FP8 is dequantized)
    python -m titan_fold.hf export DCP_FOLDER HF_FOLDER --model.name qwen3_moe --model.flavor hf \
        --model.hf_config /models/Qwen3-30B-A3B [--dtype bfloat16] [--max_shard_size 5GB]

The model: a packaged flavor (`--model.name`, `--model.flavor`), or `--model.flavor hf` with
every size from `--model.hf_config` (a config.json or the HF folder holding it). import
without a flavor builds the model from HF_FOLDER's own config.json.

import checks HF_FOLDER before writing anything: its config.json against the model (every
field that changes the computation), every safetensors file whole (header and data) and
every tensor shape; then it writes a model-only DCP checkpoint (tensors in their HF dtype).
Start training from it under any layout with `--checkpoint.initial_load_path DCP_FOLDER`
(DCP reshards on load). export reads the model tensors of any DCP checkpoint (a step-N
folder, full or model-only; the trainer's storage checks first) and writes config.json +
safetensors (+ index when several files) that transformers' from_pretrained opens, through
the same writer as the trainer's `--checkpoint.last_save_in_hf`. Neither overwrites a
non-empty folder; a failure leaves nothing behind. Errors are one line and exit code 2.
"""

import argparse
import copy
import os
import re
import shutil
import warnings

import torch

from titan_fold.checkpoint.files import (
    check_hf_checkpoint,
    check_out_folder,
    compare_shapes,
    read_hf_folder,
    read_model_tensors,
    save_model_as_hf,
)
from titan_fold.checkpoint.options import DTYPE_NAMES
from titan_fold.common.config import ConfigError
from titan_fold.models import FLAVORS, Transformer, TransformerArgs
from titan_fold.models.hf_adapter import ADAPTERS, args_from_hf_config

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_model(name: str | None, flavor: str | None, hf_config: str | None) -> tuple[str, TransformerArgs]:
    """(family, args) of `--model.name / --model.flavor [/ --model.hf_config]`; errors name the key."""
    if flavor == "hf":
        if not hf_config:
            raise ConfigError("--model.flavor hf needs --model.hf_config: a config.json or the HF folder holding it")
        return args_from_hf_config(hf_config, name)
    if hf_config:
        raise ConfigError("--model.hf_config is read only with --model.flavor hf")
    if name not in FLAVORS:
        raise ConfigError(f"--model.name {name!r}: one of {', '.join(sorted(FLAVORS))}")
    if flavor not in FLAVORS[name]:
        raise ConfigError(f"--model.flavor {flavor!r}: {name} has {', '.join([*FLAVORS[name], 'hf'])}")
    return name, copy.deepcopy(FLAVORS[name][flavor])


def model_shapes(args: TransformerArgs) -> dict[str, list[int]]:
    """Shapes of the model's state dict (a tied head is the embedding: not asked for twice)."""
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in Transformer(args).state_dict().items()}
    if args.tie_embeddings:
        del shapes["output.weight"]
    return shapes


def import_hf(hf_folder: str, out: str, family: str, args: TransformerArgs, flavor: str = "hf") -> None:
    import torch.distributed.checkpoint as dcp

    check_out_folder(out)
    check_hf_checkpoint(hf_folder, family, args, flavor)
    wanted = model_shapes(args)
    sd = ADAPTERS[family](args).from_hf(read_hf_folder(hf_folder))
    # HF has no aux-free router biases: they start at zero, as in a fresh model
    sd.update(
        {k: torch.zeros(shape) for k, shape in wanted.items() if k.endswith("router.expert_bias") and k not in sd}
    )
    compare_shapes(f"Hugging Face checkpoint {hf_folder}", {k: list(v.shape) for k, v in sd.items()}, wanted)
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save(sd, checkpoint_id=tmp, no_dist=True)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cast_weights(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Our floating weights in `dtype` (export's --dtype); the aux-free router biases stay float32."""
    if dtype is None:
        return state_dict
    return {
        k: v.to(dtype) if v.is_floating_point() and not k.endswith("expert_bias") else v for k, v in state_dict.items()
    }


def export_hf(
    dcp_folder: str,
    out: str,
    family: str,
    args: TransformerArgs,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    check_out_folder(out)
    # shapes from the metadata first: a wrong flavor fails before any tensor is read
    sd = cast_weights(read_model_tensors(dcp_folder, model_shapes(args)), dtype)
    save_model_as_hf(sd, out, family, args, max_shard_bytes=max_shard_bytes)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(f"--max_shard_size {text!r}: a positive size such as 5GB, 500MB or 1000000")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


def run(a: argparse.Namespace) -> None:
    """`python -m titan_fold.hf`'s conversion, its options parsed (options.hf_parser)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
    if a.direction == "import":
        if a.flavor is None:  # the folder's own config.json
            a.flavor, a.hf_config = "hf", a.hf_config or a.src
        family, args = resolve_model(a.name, a.flavor, a.hf_config)
        args.mtp_layers = a.mtp_layers
        import_hf(a.src, a.dst, family, args, a.flavor)
    else:
        if a.flavor is None:
            raise ConfigError(
                "export needs --model.name and --model.flavor (or --model.flavor hf --model.hf_config PATH)"
            )
        family, args = resolve_model(a.name, a.flavor, a.hf_config)
        args.mtp_layers = a.mtp_layers
        export_hf(a.src, a.dst, family, args, DTYPES.get(a.dtype), parse_size(a.max_shard_size))
    print(f"{a.direction}ed {a.src} -> {a.dst} ({family})")
