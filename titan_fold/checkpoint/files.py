"""Checkpoint folders read and written without pickle: Hugging Face safetensors folders (headers
parsed as JSON, data as raw bytes), the tensors of a DCP folder, and the shape check that runs
before any tensor is read into the model."""

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from titan_fold.checkpoint.trusted import CheckpointError, check_bytes_entries, check_storage_files, read_metadata

# ---------------------------------------------------------------- Hugging Face folders

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
HF_INDEX = "model.safetensors.index.json"


def safetensors_header(path: str) -> dict[str, dict]:
    """{key: {"dtype", "shape", "data_offsets"}} of one .safetensors file, after checking that
    the header parses and every tensor's bytes lie inside the file (a file cut anywhere fails
    here, naming the file)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            if size < 8:
                raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                raise ValueError(f"the header says {n} bytes, the file has {size - 8} after the length")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        data = size - 8 - n
        tensors = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
            begin, end = info["data_offsets"]
            if dtype is None:
                raise ValueError(f"{key}: unknown dtype {info.get('dtype')!r}")
            numel = 1
            for d in info["shape"]:
                numel *= d
            if end - begin != numel * dtype.itemsize or begin < 0:
                raise ValueError(
                    f"{key}: offsets {begin}..{end} do not hold a {info['dtype']} tensor of shape {info['shape']}"
                )
            if end > data:
                raise ValueError(f"truncated: {key} ends at byte {end} of the data, the file holds {data}")
            tensors[key] = info
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: broken safetensors file ({e})") from None
    return tensors


def hf_files(folder: str) -> list[str]:
    """The .safetensors files of an HF folder: those its index names (each must exist), else all."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: no such folder")
    index = os.path.join(folder, HF_INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({type(e).__name__}: {e})") from None
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise CheckpointError(f"{os.path.join(folder, name)}: listed in {HF_INDEX} but missing")
        return files
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors files")
    return files


def hf_headers(folder: str) -> dict[str, tuple[str, dict]]:
    """{key: (file name, header entry)} over an HF folder's files, each file checked whole."""
    entries: dict[str, tuple[str, dict]] = {}
    index = os.path.join(folder, HF_INDEX)
    weight_map = None
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    for name in hf_files(folder):
        for key, info in safetensors_header(os.path.join(folder, name)).items():
            if key in entries:
                raise CheckpointError(f"{folder}: {key} is in both {entries[key][0]} and {name}")
            entries[key] = (name, info)
    if weight_map is not None:
        for key, name in weight_map.items():
            if entries.get(key, (None,))[0] != name:
                raise CheckpointError(
                    f"{os.path.join(folder, name)}: {HF_INDEX} lists {key} in it, the file does not hold it"
                )
    return entries


def hf_shapes(folder: str) -> dict[str, tuple[list[int], str]]:
    """{key: (shape, dtype)} from the checked headers of an HF folder's safetensors files."""
    return {k: (info["shape"], info["dtype"]) for k, (_, info) in hf_headers(folder).items()}


def read_hf_folder(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder (no pickle involved), after checking every file whole."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for key, (name, _) in hf_headers(folder).items():
        by_file.setdefault(name, []).append(key)
    sd = {}
    for name, keys in by_file.items():
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            sd.update({k: f.get_tensor(k) for k in keys})
    return sd


def check_hf_checkpoint(folder: str, family: str, model_args, flavor: str = "hf") -> None:
    """An HF folder against a model, before anything is read into it: its config.json field by
    field (models/hf_adapter.check_hf_config), every safetensors file whole, and the tensor
    shapes against the model's (built on the meta device)."""
    from titan_fold.models import Transformer
    from titan_fold.models.hf_adapter import ADAPTERS, check_hf_config

    check_hf_config(folder, family, model_args, flavor)
    adapter = ADAPTERS[family](model_args)
    saved = adapter.hf_shapes_for_model({k: shape for k, (shape, _) in hf_shapes(folder).items()})
    with torch.device("meta"):
        model = Transformer(model_args)
    wanted = {k: list(v.shape) for k, v in adapter.to_hf(model.state_dict()).items()}
    compare_shapes(f"Hugging Face checkpoint {folder}", saved, wanted)


def check_initial_hf_load(config, model_args) -> None:
    """The trainer's `--checkpoint.initial_load_in_hf`, checked before any process group: the
    same checks as `python -m titan_fold.hf import`. torchtitan reads the HF folder only when
    the run has no checkpoint of its own yet."""
    ckpt = config.checkpoint
    if not (ckpt.enable and ckpt.initial_load_in_hf):
        return
    if os.path.isdir(os.path.join(config.job.dump_folder, ckpt.folder)):
        return
    folder = ckpt.initial_load_path or config.model.hf_assets_path
    check_hf_checkpoint(folder, config.model.name, model_args, config.model.flavor)
    if mxfp4 := [k for k in hf_shapes(folder) if k.endswith("_blocks")]:
        raise CheckpointError(
            f"{folder}: MXFP4 experts ({mxfp4[0]}, ...) are dequantized by `python -m titan_fold.hf import "
            f"{folder} DCP_FOLDER` only; import it, then start from --checkpoint.initial_load_path DCP_FOLDER"
        )


def nonzero_expert_bias(state_dict: dict[str, Any], family: str) -> str | None:
    """The first aux-free router bias that is not zero, for a family whose Hugging Face model has
    no place for it (it would route differently there); None if there is none."""
    from titan_fold.models.hf_adapter import ADAPTERS

    if getattr(ADAPTERS[family], "exports_expert_bias", False):
        return None
    return next((k for k, v in state_dict.items() if k.endswith("router.expert_bias") and torch.count_nonzero(v)), None)


def save_model_as_hf(
    state_dict: dict[str, Any],
    folder: str,
    family: str,
    model_args,
    write: bool = True,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Our model state dict (plain or DTensor) -> an HF folder that from_pretrained opens."""
    from titan_fold.models.hf_adapter import ADAPTERS, hf_config

    biased = nonzero_expert_bias(state_dict, family)
    if biased:
        raise CheckpointError(
            f"{folder}: the aux-free router biases are not zero ({biased}, ...): Hugging Face models have no "
            "place for them and would route differently; nothing was written"
        )
    config = hf_config(family, model_args)
    save_hf_folder(ADAPTERS[family](model_args).to_hf(state_dict), folder, config, max_shard_bytes, write)


def _dtype_name(tensors) -> str:
    """The dtype of the floating tensors (by bytes, when mixed), as config.json names it."""
    weights: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.dtype.is_floating_point:
            weights[t.dtype] = weights.get(t.dtype, 0) + t.numel() * t.dtype.itemsize
    return str(max(weights, key=weights.__getitem__) if weights else torch.float32).removeprefix("torch.")


def check_out_folder(folder: str) -> None:
    """Nothing saved is overwritten: a folder that exists must be empty."""
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise CheckpointError(f"{folder}: exists and is not empty; choose a new folder (nothing was written)")


def save_hf_folder(
    hf_state_dict: dict[str, torch.Tensor],
    folder: str,
    config: dict,
    max_shard_bytes: int = 5 * 2**30,
    write: bool = True,
) -> None:
    """The one HF writer (`python -m titan_fold.hf export` and `--checkpoint.last_save_in_hf`).

    DTensors are gathered one at a time, as their shard is written (a collective: every rank
    calls this; only ranks with write=True touch the disk), so no rank holds more than one
    shard. The folder's files: write_hf_folder.
    """
    tensors = (
        (k, (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu").contiguous())
        for k, t in hf_state_dict.items()
    )
    write_hf_folder(hf_state_dict, tensors, folder, config, max_shard_bytes, write)


def write_hf_folder(
    planned: dict[str, torch.Tensor],
    tensors: Iterator[tuple[str, torch.Tensor]],
    folder: str,
    config: dict,
    max_shard_bytes: int = 5 * 2**30,
    write: bool = True,
) -> None:
    """Writes config.json (its torch_dtype / dtype those of the tensors), model.safetensors, or
    model-0000i-of-0000N.safetensors + model.safetensors.index.json when the tensors exceed
    max_shard_bytes, into `folder`.tmp, then renames it to `folder`: a failure leaves no
    partial folder.

    planned: every tensor's name, shape and dtype (meta tensors will do), in the order
    `tensors` yields them, whole; the shards are cut from it before any tensor is read. On
    ranks with write=False, `tensors` is drained (its collectives run) and nothing is written.
    """
    from safetensors.torch import save_file

    check_out_folder(folder)
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in planned.items():
        nbytes = t.numel() * t.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    if not write:
        for _ in tensors:  # this rank's part in the gathers
            pass
        return
    tmp = folder.rstrip("/") + ".tmp"
    failed: OSError | None = None  # a failed write stops the writing, not this rank's part in the gathers
    try:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    except OSError as e:
        failed = e
    try:
        for name, keys in zip(names, shards, strict=True):
            shard = {}
            for k in keys:
                got, t = next(tensors)
                assert got == k, f"the writer expected {k}, the tensors gave {got}"
                shard[k] = t.detach().to("cpu").contiguous()
            if failed is None:
                try:
                    save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
                except OSError as e:
                    failed = e
            del shard
        if failed is not None:
            raise failed
        dtype = _dtype_name(planned.values())
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**config, "torch_dtype": dtype, "dtype": dtype}, f, indent=2)
        if len(shards) > 1:
            total = sum(t.numel() * t.dtype.itemsize for t in planned.values())
            weight_map = {k: name for name, keys in zip(names, shards, strict=True) for k in keys}
            with open(os.path.join(tmp, HF_INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        if os.path.isdir(folder):
            os.rmdir(folder)  # empty (checked above)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_model_tensors(folder: str, wanted: dict[str, list[int]] | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP checkpoint (model-only or full), whole, on one process.

    The trainer's checks come first (allow-listed metadata, data files present and long
    enough) and, given the model's shapes `wanted`, the shapes: a wrong flavor fails before
    any tensor is read.
    """
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata(folder)
    check_storage_files(folder, metadata)
    model_prefixes = ("tok_embeddings.", "layers.", "norm.", "output.", "mtp.")
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and k.startswith(model_prefixes)
    }
    if not sd:
        raise CheckpointError(f"{folder}: no model tensors")
    if wanted is not None:
        compare_shapes(f"checkpoint {folder}", {k: list(v.shape) for k, v in sd.items()}, wanted)
        sd = {k: v for k, v in sd.items() if k in wanted}
    dcp.load(sd, checkpoint_id=folder, no_dist=True)
    return sd


# ---------------------------------------------------------------- validation


def _shape(value: Any) -> list[int] | None:
    # a DTensor's shape is its global shape, which is what DCP records
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def compare_shapes(where: str, saved: dict[str, list[int]], wanted: dict[str, list[int]]) -> None:
    """Raise one CheckpointError listing every tensor the model wants that `saved` lacks or shapes differently."""
    missing = sorted(k for k in wanted if k not in saved)
    # embedding and head first: a vocabulary or width change shows there at once
    wrong = sorted(
        (k for k in wanted if k in saved and list(saved[k]) != list(wanted[k])),
        key=lambda k: (not k.startswith(("tok_embeddings.", "output.")), k),
    )
    if not missing and not wrong:
        return
    lines = [f"{where} does not fit this model; nothing was loaded."]
    for k in wrong[:8]:
        lines.append(f"  {k}: checkpoint {list(saved[k])}, model {list(wanted[k])}")
    if len(wrong) > 8:
        lines.append(f"  ... and {len(wrong) - 8} more shape mismatches")
    if missing:
        lines.append(
            f"  missing from the checkpoint ({len(missing)}): {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    hints = []
    if any(
        k.endswith(("tok_embeddings.weight", "output.weight", "embed_tokens.weight", "lm_head.weight")) for k in wrong
    ):
        hints.append("the vocabulary size differs")
    if any(k.endswith("moe.experts.w13") and k[: -len("w13")] + "w1" in saved for k in missing):
        hints.append(
            "it holds the routed experts' gate and up projections apart (experts.w1 / w3), as titan_fold "
            "did before experts.w13: convert it with the code that saved it (python -m titan_fold.hf export) "
            "and start from that Hugging Face folder"
        )
    elif wrong or missing:
        hints.append("check --model.name / --model.flavor (and the [moe] shapes) against the run that saved it")
    lines.append("  hint: " + "; ".join(hints))
    raise CheckpointError("\n".join(lines))


def validate_against(
    checkpoint_id: str, state_dict: dict[str, Any], from_hf_state_dict: dict[str, Any] | None = None, adapter=None
) -> None:
    """Compare the checkpoint's tensor shapes with what is about to be loaded into, before any read.

    state_dict: the (flattened) states torchtitan passes to dcp.load; for an HF load,
    from_hf_state_dict is the adapter's to_hf of the model state dict instead, and the folder's
    tensors are seen as the adapter reads them (its hf_shapes_for_model).
    """
    if from_hf_state_dict is not None:
        saved = {k: shape for k, (shape, _) in hf_shapes(checkpoint_id).items()}  # every file checked whole
        if adapter is not None:
            saved = adapter.hf_shapes_for_model(saved)
        wanted = {k: s for k, v in from_hf_state_dict.items() if (s := _shape(v)) is not None}
        compare_shapes(f"Hugging Face checkpoint {checkpoint_id}", saved, wanted)
        return
    metadata = read_metadata(checkpoint_id)
    check_storage_files(checkpoint_id, metadata)
    check_bytes_entries(checkpoint_id, metadata)
    saved = {
        k: list(md.size) for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
    }
    # model tensors are top-level keys; optimizer / scheduler / data states are nested and
    # DCP checks them itself (they follow the model's shapes)
    wanted = {k: s for k, v in state_dict.items() if (s := _shape(v)) is not None}
    compare_shapes(f"checkpoint {checkpoint_id}", saved, wanted)
