"""Checkpoint safety around torchtitan's CheckpointManager: check before load, trust nothing.

What torchtitan 0.2.2 + DCP already guarantee (read from their source, tested here):
- completeness: DCP writes every rank's `__r_i.distcp` first, then the coordinator writes
  `.metadata.tmp` (fsync) and renames it to `.metadata`; `CheckpointManager._find_load_step`
  only considers `step-N` folders holding `.metadata` (or, for HF exports,
  `model.safetensors.index.json`, written by the consolidation at the very end). A save cut
  by a kill has no `.metadata` and is never picked as the latest, so no marker of our own
  is needed; `complete(folder)` states the same rule for our tools.
- resharding: DCP reads any saved DTensor layout into any other (model, optimizer).

What this module adds (`FoldCheckpointManager`, the trainer's checkpoint manager):
- before any tensor is read, the checkpoint's shapes are compared with the model's
  (`validate_against`): a wrong flavor, vocabulary or family fails with one message that
  names the tensors, and the model is not touched; missing or truncated data files are
  caught the same way (bit flips inside a file are not: DCP keeps no checksums);
- the trust boundary of DCP's files: `.metadata` is a pickle, and DCP's default planner
  reads non-tensor values (train_state, the data loader's and RNG state) with
  `torch.load(weights_only=False)`. Before DCP reads anything, `read_metadata` unpickles
  `.metadata` with an allow-list (DCP's metadata classes, torch.Size / dtype, paths,
  OrderedDict) and every non-tensor entry is test-loaded with `torch.load(weights_only=True)`;
  a checkpoint that would need anything else is refused. HF safetensors are parsed as
  JSON headers + raw bytes (never pickle). Any torch.load here uses weights_only=True;
- the RNG state (torch's CPU generator, and CUDA's when present) in the checkpoint;
- the run's settings (`settings`, written as SETTINGS_FILE into each step-N), which a resume
  is compared with (settings.py); one log line per save;
- a resume runs with its own lr schedule (optimizer.lr, lr_scheduler.*, training.steps) from
  its first step (`apply_lr_schedule`), not with the saved run's for one step;
- a resume from a step-N that holds the weights only (the last save, by default) goes on
  from step N with the data position its save recorded and a fresh optimizer state
  (`load_weights_only`), where torchtitan's load would fail;
- a save that fails for want of storage fails on every rank alike, and faults injected by the
  tests (saves.py).
"""

import json
import os
import shutil
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import DATALOADER, LR_SCHEDULER, TRAIN_STATE, AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from titan_fold.checkpoint.saves import SaveFault, agree, failing_save, fault
from titan_fold.checkpoint.trusted import CheckpointError, check_bytes_entries, check_storage_files, read_metadata


def complete(folder: str) -> bool:
    """A DCP checkpoint is complete once its `.metadata` exists (written last, atomically)."""
    return os.path.isfile(os.path.join(folder, ".metadata")) or os.path.isfile(
        os.path.join(folder, "model.safetensors.index.json")
    )


# ---------------------------------------------------------------- Hugging Face folders

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
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
                raise ValueError(f"{key}: offsets {begin}..{end} do not hold a {info['dtype']} tensor of shape {info['shape']}")
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
                raise CheckpointError(f"{os.path.join(folder, name)}: {HF_INDEX} lists {key} in it, the file does not hold it")
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


def save_model_as_hf(state_dict: dict[str, Any], folder: str, family: str, model_args, write: bool = True,
                     max_shard_bytes: int = 5 * 2**30) -> None:
    """Our model state dict (plain or DTensor) -> an HF folder that from_pretrained opens."""
    from titan_fold.models.hf_adapter import ADAPTERS, hf_config

    biased = [k for k, v in state_dict.items() if k.endswith("router.expert_bias") and torch.count_nonzero(v)]
    if biased and not getattr(ADAPTERS[family], "exports_expert_bias", False):
        raise CheckpointError(
            f"{folder}: the aux-free router biases are not zero ({biased[0]}, ...): Hugging Face models have no "
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
    return str(max(weights, key=weights.get) if weights else torch.float32).removeprefix("torch.")


def save_hf_folder(hf_state_dict: dict[str, torch.Tensor], folder: str, config: dict,
                   max_shard_bytes: int = 5 * 2**30, write: bool = True) -> None:
    """The one HF writer (`python -m titan_fold.hf export` and `--checkpoint.last_save_in_hf`).

    Writes config.json (its torch_dtype / dtype those of the tensors), model.safetensors, or
    model-0000i-of-0000N.safetensors + model.safetensors.index.json when the tensors exceed
    max_shard_bytes, into `folder`.tmp, then renames it to `folder`: a failure leaves no
    partial folder. DTensors are gathered one shard at a time (a collective: every rank calls
    this; only ranks with write=True touch the disk), so no rank holds more than one shard.
    """
    from safetensors.torch import save_file

    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise CheckpointError(f"{folder}: exists and is not empty; nothing was written")
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in hf_state_dict.items():
        nbytes = t.numel() * t.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    tmp = folder.rstrip("/") + ".tmp"
    failed: OSError | None = None  # a failed write stops the writing, not this rank's part in the gathers
    if write:
        try:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except OSError as e:
            failed = e
    try:
        for name, keys in zip(names, shards):
            tensors = {}
            for k in keys:
                t = hf_state_dict[k]
                t = t.full_tensor() if isinstance(t, DTensor) else t
                tensors[k] = t.detach().to("cpu").contiguous()
            if write and failed is None:
                try:
                    save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
                except OSError as e:
                    failed = e
        if failed is not None:
            raise failed
        if write:
            dtype = _dtype_name(hf_state_dict.values())
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump({**config, "torch_dtype": dtype, "dtype": dtype}, f, indent=2)
            if len(shards) > 1:
                total = sum(t.numel() * t.dtype.itemsize for t in hf_state_dict.values())
                weight_map = {k: name for name, keys in zip(names, shards) for k in keys}
                with open(os.path.join(tmp, HF_INDEX), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            if os.path.isdir(folder):
                os.rmdir(folder)  # empty (checked above)
            os.replace(tmp, folder)
    except BaseException:
        if write:
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
        lines.append(f"  missing from the checkpoint ({len(missing)}): {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    hints = []
    if any(k.endswith(("tok_embeddings.weight", "output.weight", "embed_tokens.weight", "lm_head.weight")) for k in wrong):
        hints.append("the vocabulary size differs")
    if any(k.endswith("moe.experts.w13") and k[: -len("w13")] + "w1" in saved for k in missing):
        hints.append("it holds the routed experts' gate and up projections apart (experts.w1 / w3), as titan_fold "
                     "did before experts.w13: convert it with the code that saved it (python -m titan_fold.hf export) "
                     "and start from that Hugging Face folder")
    elif wrong or missing:
        hints.append("check --model.name / --model.flavor (and the [moe] shapes) against the run that saved it")
    lines.append("  hint: " + "; ".join(hints))
    raise CheckpointError("\n".join(lines))


def validate_against(checkpoint_id: str, state_dict: dict[str, Any], from_hf_state_dict: dict[str, Any] | None = None) -> None:
    """Compare the checkpoint's tensor shapes with what is about to be loaded into, before any read.

    state_dict: the (flattened) states torchtitan passes to dcp.load; for an HF load,
    from_hf_state_dict is the adapter's to_hf of the model state dict instead.
    """
    if from_hf_state_dict is not None:
        saved = {k: shape for k, (shape, _) in hf_shapes(checkpoint_id).items()}  # every file checked whole
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


# ---------------------------------------------------------------- RNG state


class RNGState(Stateful):
    """torch's CPU generator state (and the current CUDA device's), saved as uint8 tensors.

    A plain tensor in DCP is saved once (rank 0's copy) and loaded on every rank: all
    ranks resume with rank 0's state. torchtitan seeds every rank alike (apart from pp
    stages), so this is the state every rank had.
    """

    def state_dict(self) -> dict[str, torch.Tensor]:
        sd = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state_dict["cpu"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


SETTINGS_FILE = "titan_fold_settings.json"  # FoldCheckpointManager.settings, in every step-N (settings.py)
POSITION = "position"  # SETTINGS_FILE's record of the step, tokens seen and data position


def weights_only(folder: str) -> bool:
    """A complete checkpoint without the train state: a save of the model only (DCP or HF)."""
    if os.path.isfile(os.path.join(folder, ".metadata")):
        return "train_state.step" not in read_metadata(folder).state_dict_metadata
    return complete(folder)


def saved_position(folder: str, step: int) -> dict[str, int]:
    """The position SETTINGS_FILE recorded at the save of `folder`; for a checkpoint saved
    before it did, `step` global batches of its settings (exact unless the batch changed)."""
    path = os.path.join(folder, SETTINGS_FILE)
    try:
        with open(path) as f:
            saved = json.load(f)
        if POSITION in saved:
            return {k: int(v) for k, v in saved[POSITION].items()}
        sequences = step * int(saved["training.global_batch_size"])
        return {"train_state.step": step, "train_state.ntokens_seen": sequences * int(saved["training.seq_len"]),
                "dataloader.consumed_sequences": sequences}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{folder} holds the weights only and no readable record of its data position ({path}: {e}); start "
            f"another job.dump_folder from its weights with --checkpoint.initial_load_path {folder}") from None


# ---------------------------------------------------------------- the trainer's manager


class FoldCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager, checking shapes before DCP reads, and saving the RNG state.

    FoldTrainer builds it where torchtitan's Trainer builds its own (trainer/torchtitan_adapter.py).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.enable:
            self.states["rng"] = RNGState()
        # this run's lr per param group, before a load puts the saved run's in their place
        self.base_lrs = [list(s.base_lrs) for s in self.states[LR_SCHEDULER].schedulers]
        self.settings: dict[str, Any] | None = None  # settings.run_settings(), saved in each step-N
        self.last_saved: tuple[int, bool] | None = None  # (step, last_step) of this run's latest save

    def describe_save(self, step: int, last_step: bool) -> str:
        """The folder of a save and, unless it is a full DCP checkpoint, what it holds."""
        path = self._create_checkpoint_id(step)
        if last_step and self.last_save_in_hf:
            return f"{path} (Hugging Face safetensors: checkpoint.last_save_in_hf)"
        if last_step and self.last_save_model_only and step > 0:
            dtype = str(self.export_dtype).removeprefix("torch.")
            return f"{path} (weights only, {dtype}: checkpoint.last_save_model_only)"
        if self.async_mode != AsyncMode.DISABLED:
            return f"{path} (asynchronous save)"
        return path

    def save(self, curr_step: int, last_step: bool = False) -> None:
        """torchtitan's save; one line per save in place of its four. A save that fails for want
        of storage fails on every rank with SaveError."""
        if not self._should_save(curr_step, last_step):
            return super().save(curr_step, last_step)
        begin = time.monotonic()
        with failing_save(self._create_checkpoint_id(curr_step)):
            super().save(curr_step, last_step)
        self.last_saved = (curr_step, last_step)
        logger.info(f"checkpoint {self.describe_save(curr_step, last_step)} saved in {time.monotonic() - begin:.2f} s")

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        # DCP's own steps agree on a failure of any rank; the writes before and around them
        # are agreed on here, so that no rank waits in a collective its peers left
        if not to_hf:
            agree(lambda: self._save_settings(checkpoint_id))
            kind = fault(int(os.path.basename(checkpoint_id).removeprefix("step-")))
            if kind not in (None, "kill"):  # tests: this rank's write fails (SaveFault)
                state_dict = {**state_dict, "save_fault": SaveFault(kind, checkpoint_id)}
            return super().dcp_save(state_dict, checkpoint_id=checkpoint_id, async_mode=async_mode,
                                    enable_garbage_collection=enable_garbage_collection)
        # the same writer as `python -m titan_fold.hf export`: config.json, safetensors, index
        adapter = self.sd_adapter
        agree(lambda: save_model_as_hf(state_dict, checkpoint_id, adapter.family, adapter.model_args,
                                       write=not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0))
        return None

    def save_now(self, step: int) -> None:
        """A full (resumable) checkpoint of `step`, off the interval, synchronously (a stop
        request's save). torchtitan 0.2.2's save only saves on the interval or as the last step,
        which may be model-only (checkpoint.last_save_model_only): these are the calls its save
        makes for an interval step, after any asynchronous save still running."""
        self.wait_for_async_save()
        with failing_save(self._create_checkpoint_id(step)):
            self.dcp_save(self._flattened_model_states_sd(), checkpoint_id=self._create_checkpoint_id(step),
                          async_mode=AsyncMode.DISABLED)

    def wait_for_async_save(self) -> None:
        """Returns when the asynchronous save in flight, if any, has finished (it runs collectives
        on a process group of its own, which must end before the process does)."""
        self._async_wait()

    def _save_settings(self, checkpoint_id: str) -> None:
        # written before DCP's files: the .metadata that completes the checkpoint comes last
        if self.settings is None or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
            return
        os.makedirs(checkpoint_id, exist_ok=True)
        train_state = self.states[TRAIN_STATE].state_dict()
        # the position, also for a save of the weights only (load_weights_only)
        position = {"train_state.step": train_state["step"], "train_state.ntokens_seen": train_state["ntokens_seen"],
                    "dataloader.consumed_sequences": self.states[DATALOADER].state_dict()["consumed_sequences"]}
        with open(os.path.join(checkpoint_id, SETTINGS_FILE), "w") as f:
            json.dump({**self.settings, POSITION: position}, f, indent=1)

    def load(self, step: int = -1) -> bool:
        """torchtitan's load; a step-N (N > 0) of the run's own folder that holds the weights
        only (checkpoint.last_save_model_only, the default for the last step) goes on from
        step N with a fresh optimizer state (load_weights_only) where torchtitan's would fail."""
        if self.enable and os.path.isdir(self.folder):
            found = self._find_load_step() if step == -1 else step
            checkpoint_id = self._create_checkpoint_id(found)
            if found > 0 and weights_only(checkpoint_id):
                self.load_weights_only(found, checkpoint_id)
                return True
        return super().load(step)

    def load_weights_only(self, step: int, checkpoint_id: str) -> None:
        """The weights of `checkpoint_id`; the step, tokens seen and data position its save
        recorded (SETTINGS_FILE); the lr schedule at that step; the optimizer's moments zero."""
        position = saved_position(checkpoint_id, step)
        logger.info(f"Loading the checkpoint from {checkpoint_id}.")
        hf = not os.path.isfile(os.path.join(checkpoint_id, ".metadata"))
        self.dcp_load(self._states_to_load(model_only=True), checkpoint_id=checkpoint_id, from_hf=hf,
                      from_quantized=False)
        self.states[TRAIN_STATE].load_state_dict(
            {"step": step, "ntokens_seen": position["train_state.ntokens_seen"]})
        dataloader = self.states[DATALOADER]
        dataloader.load_state_dict(
            {**dataloader.state_dict(), "consumed_sequences": position["dataloader.consumed_sequences"]})
        for scheduler in self.states[LR_SCHEDULER].schedulers:
            scheduler.last_epoch = step
        self.apply_lr_schedule()
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            logger.warning(
                f"resuming {checkpoint_id}, which holds the weights only (checkpoint.last_save_model_only): training "
                f"goes on from step {step + 1} with the data from sequence {position['dataloader.consumed_sequences']} "
                f"and the lr schedule at step {step}, the optimizer state starting afresh")

    def apply_lr_schedule(self) -> None:
        """This run's lr schedule (optimizer.lr, lr_scheduler.*, training.steps) at the loaded
        step, in the optimizers from the first step on: a load puts the saved run's base lr
        into the schedulers and the lr its schedule gave for the next step into the optimizers.
        The same computation as LambdaLR's step: with unchanged settings, the saved values."""
        for scheduler, base_lrs in zip(self.states[LR_SCHEDULER].schedulers, self.base_lrs, strict=True):
            lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(base_lrs, scheduler.lr_lambdas, strict=True)]
            for group, base, lr in zip(scheduler.optimizer.param_groups, base_lrs, lrs, strict=True):
                group["initial_lr"], group["lr"] = base, lr
            scheduler.base_lrs, scheduler._last_lr = list(base_lrs), lrs

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        hf = self.sd_adapter.to_hf(dict(state_dict)) if from_hf else None
        validate_against(checkpoint_id, state_dict, hf)
        super().dcp_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)
        if LR_SCHEDULER in state_dict:
            self.apply_lr_schedule()
