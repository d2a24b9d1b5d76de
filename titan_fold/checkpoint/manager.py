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
import time
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import DATALOADER, LR_SCHEDULER, TRAIN_STATE, AsyncMode
from torchtitan.tools.logging import logger

from titan_fold.checkpoint.files import save_model_as_hf, validate_against
from titan_fold.checkpoint.saves import SaveFault, agree, failing_save, fault
from titan_fold.checkpoint.trusted import CheckpointError, read_metadata
from titan_fold.compat.titan import CheckpointManagerHooks


def complete(folder: str) -> bool:
    """A DCP checkpoint is complete once its `.metadata` exists (written last, atomically)."""
    return os.path.isfile(os.path.join(folder, ".metadata")) or os.path.isfile(
        os.path.join(folder, "model.safetensors.index.json")
    )


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
        return {
            "train_state.step": step,
            "train_state.ntokens_seen": sequences * int(saved["training.seq_len"]),
            "dataloader.consumed_sequences": sequences,
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{folder} holds the weights only and no readable record of its data position ({path}: {e}); start "
            f"another job.dump_folder from its weights with --checkpoint.initial_load_path {folder}"
        ) from None


# ---------------------------------------------------------------- the trainer's manager


class FoldCheckpointManager(CheckpointManagerHooks):
    """torchtitan's CheckpointManager, checking shapes before DCP reads, and saving the RNG state.

    FoldTrainer builds it (trainer/fold_trainer.py: build_checkpointer).
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
        path = self.checkpoint_id(step)
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
        if not self.should_save(curr_step, last_step):
            return super().save(curr_step, last_step)
        begin = time.monotonic()
        with failing_save(self.checkpoint_id(curr_step)):
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
            return super().dcp_save(
                state_dict,
                checkpoint_id=checkpoint_id,
                async_mode=async_mode,
                enable_garbage_collection=enable_garbage_collection,
            )
        # the same writer as `python -m titan_fold.hf export`: config.json, safetensors, index
        adapter = self.sd_adapter
        agree(
            lambda: save_model_as_hf(
                state_dict,
                checkpoint_id,
                adapter.family,
                adapter.model_args,
                write=not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0,
            )
        )
        return None

    def save_now(self, step: int) -> None:
        """A full (resumable) checkpoint of `step`, off the interval, synchronously (a stop
        request's save). torchtitan 0.2.2's save only saves on the interval or as the last step,
        which may be model-only (checkpoint.last_save_model_only): these are the calls its save
        makes for an interval step, after any asynchronous save still running."""
        self.wait_for_async_save()
        with failing_save(self.checkpoint_id(step)):
            self.dcp_save(
                self.flattened_model_states_sd(),
                checkpoint_id=self.checkpoint_id(step),
                async_mode=AsyncMode.DISABLED,
            )

    def wait_for_async_save(self) -> None:
        """Returns when the asynchronous save in flight, if any, has finished (it runs collectives
        on a process group of its own, which must end before the process does)."""
        self.async_wait()

    def _save_settings(self, checkpoint_id: str) -> None:
        # written before DCP's files: the .metadata that completes the checkpoint comes last
        if self.settings is None or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
            return
        os.makedirs(checkpoint_id, exist_ok=True)
        train_state = self.states[TRAIN_STATE].state_dict()
        # the position, also for a save of the weights only (load_weights_only)
        position = {
            "train_state.step": train_state["step"],
            "train_state.ntokens_seen": train_state["ntokens_seen"],
            "dataloader.consumed_sequences": self.states[DATALOADER].state_dict()["consumed_sequences"],
        }
        with open(os.path.join(checkpoint_id, SETTINGS_FILE), "w") as f:
            json.dump({**self.settings, POSITION: position}, f, indent=1)

    def load(self, step: int = -1) -> bool:
        """torchtitan's load; a step-N (N > 0) of the run's own folder that holds the weights
        only (checkpoint.last_save_model_only, the default for the last step) goes on from
        step N with a fresh optimizer state (load_weights_only) where torchtitan's would fail."""
        if self.enable and os.path.isdir(self.folder):
            found = self.find_load_step() if step == -1 else step
            checkpoint_id = self.checkpoint_id(found)
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
        self.dcp_load(
            self.states_to_load(model_only=True), checkpoint_id=checkpoint_id, from_hf=hf, from_quantized=False
        )
        self.states[TRAIN_STATE].load_state_dict({"step": step, "ntokens_seen": position["train_state.ntokens_seen"]})
        dataloader = self.states[DATALOADER]
        dataloader.load_state_dict(
            {**dataloader.state_dict(), "consumed_sequences": position["dataloader.consumed_sequences"]}
        )
        for scheduler in self.states[LR_SCHEDULER].schedulers:
            scheduler.last_epoch = step
        self.apply_lr_schedule()
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            logger.warning(
                f"resuming {checkpoint_id}, which holds the weights only (checkpoint.last_save_model_only): training "
                f"goes on from step {step + 1} with the data from sequence {position['dataloader.consumed_sequences']} "
                f"and the lr schedule at step {step}, the optimizer state starting afresh"
            )

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
        validate_against(checkpoint_id, state_dict, hf, self.sd_adapter if from_hf else None)
        super().dcp_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)
        if LR_SCHEDULER in state_dict:
            self.apply_lr_schedule()
