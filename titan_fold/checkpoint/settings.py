"""The settings a checkpoint records and a resume is compared with.

Every `step-N` the trainer saves holds SETTINGS_FILE (written before DCP's files, whose
`.metadata` completes the checkpoint). A resume of that checkpoint continues the saved run:
the same tokens (sequence length, tokenizer) in the same model (FIXED); a difference there
is a CheckpointError naming the key and the checkpoint's value, raised before any process
group. So is a switch between Adam / AdamW and Muon (optimizer.name), whose states differ. Settings a resume may change, though the run then differs from the saved one
(MENTIONED: global batch, step count, lr schedule), give one warning line each. Layouts are
not compared: DCP reshards between them.
"""

import hashlib
import json
import os
from typing import Any

from titan_fold.checkpoint.manager import SETTINGS_FILE, CheckpointError, complete

# a resume continues the saved run: the same tokens (sequence length, tokenizer) in the same model
FIXED = ("training.seq_len", "model.name", "model.flavor", "tokenizer")
# may change on resume, and the run then differs from the saved one: said in one line each
MENTIONED = (
    "training.global_batch_size",
    "training.steps",
    "optimizer.lr",
    "lr_scheduler.warmup_steps",
    "lr_scheduler.decay_ratio",
    "lr_scheduler.decay_type",
    "lr_scheduler.min_lr_factor",
)


def tokenizer_identity(tokenizer, config) -> str:
    """The tokenizer as a checkpoint records it: its kind, vocabulary size and, for an HF
    tokenizer, a hash of its file (the folder may move, the tokens must not change)."""
    size = tokenizer.get_vocab_size()
    path = config.model.hf_assets_path
    files = [os.path.join(path, f) for f in ("tokenizer.json", "vocab.json", "vocab.txt")] if path else []
    found = next((f for f in files if os.path.isfile(f)), None)
    if found is None or type(tokenizer).__name__ == "ByteTokenizer":
        return f"byte-level, {size} tokens"
    with open(found, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return f"{os.path.basename(found)} sha256 {digest}, {size} tokens"


def run_settings(config, tokenizer, dp: int) -> dict[str, Any]:
    """The settings of FIXED and MENTIONED of this run (the global batch as trained: -1 = local x dp)."""
    tr, lr = config.training, config.lr_scheduler
    return {
        "training.seq_len": tr.seq_len,
        "model.name": config.model.name,
        "model.flavor": config.model.flavor,
        "tokenizer": tokenizer_identity(tokenizer, config),
        "training.global_batch_size": tr.global_batch_size if tr.global_batch_size > 0 else tr.local_batch_size * dp,
        "training.steps": tr.steps,
        "optimizer.lr": config.optimizer.lr,
        "optimizer.name": config.optimizer.name,
        "lr_scheduler.warmup_steps": lr.warmup_steps,
        "lr_scheduler.decay_ratio": lr.decay_ratio,
        "lr_scheduler.decay_type": lr.decay_type,
        "lr_scheduler.min_lr_factor": lr.min_lr_factor,
    }


def resume_folder(config) -> str | None:
    """The step-N folder torchtitan's CheckpointManager.load will resume from, if any."""
    ckpt = config.checkpoint
    folder = os.path.join(config.job.dump_folder, ckpt.folder)
    if not ckpt.enable or not os.path.isdir(folder):
        return None
    if ckpt.load_step != -1:
        step = ckpt.load_step
    else:
        steps = [int(d[5:]) for d in os.listdir(folder) if d.startswith("step-") and d[5:].isdigit()]
        done = [n for n in steps if complete(os.path.join(folder, f"step-{n}"))]
        if not done:
            return None
        step = max(done)
    return os.path.join(folder, f"step-{step}") if step > 0 else None


def check_resume_step(config) -> None:
    """training.steps counts the run's steps from its start, the resumed ones included, as
    torchtitan's training.steps and Megatron-LM's --train-iters do: a resume whose checkpoint
    is past it has nothing left to train, and its lr schedule ends before that step."""
    folder = resume_folder(config)
    if folder is None:
        return
    step, steps = int(os.path.basename(folder).removeprefix("step-")), config.training.steps
    if step > steps:
        raise CheckpointError(
            f"training.steps = {steps}, but {folder} is at step {step}: training.steps counts every step of the "
            f"run, the resumed ones included, so nothing is left to train; give --training.steps {step + 1} or "
            f"more to train on, or another job.dump_folder to start afresh"
        )


def check_resume(config, settings: dict[str, Any]) -> list[str]:
    """Compare this run's settings with those of the checkpoint it resumes: a FIXED one that
    differs is a CheckpointError naming the key and the checkpoint's value; -> one line per
    MENTIONED one that differs. Checkpoints without a settings file are not checked."""
    folder = resume_folder(config)
    path = os.path.join(folder, SETTINGS_FILE) if folder else None
    if path is None or not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    for key in FIXED:
        if key in saved and saved[key] != settings[key]:
            raise CheckpointError(
                f"{key} = {settings[key]!r}, but {folder} was saved with {key} = {saved[key]!r}: a resume keeps "
                f"it (to start from these weights with new settings: another job.dump_folder and "
                f"--checkpoint.initial_load_path {folder})"
            )
    old, new = saved.get("optimizer.name"), settings["optimizer.name"]
    if old is not None and (old == "Muon") != (new == "Muon"):
        raise CheckpointError(
            f"optimizer.name = {new!r}, but {folder} was saved with optimizer.name = {old!r}: their states differ "
            f"(Muon keeps one momentum per matrix, Adam two moments), so a resume keeps it (to start from these "
            f"weights with a fresh optimizer: another job.dump_folder and --checkpoint.initial_load_path {folder})"
        )
    return [
        f"resuming {folder} with {key} = {settings[key]!r} (saved with {saved[key]!r}): the run continues "
        f"with the new value"
        for key in MENTIONED
        if key in saved and saved[key] != settings[key]
    ]
