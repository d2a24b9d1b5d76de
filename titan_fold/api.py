"""The Python entry point for an RL loop: a trainer built from a job config, driven a batch at a time.

    from titan_fold.api import Trainer

    trainer = Trainer.from_config("debug_moe.toml", overrides=["--job.dump_folder", "out"])
    for step in range(steps):
        rollouts = ...                                  # sampled by the inference engine
        old = trainer.logprobs(rollouts)                # [len(tokens)] per record, no grad
        metrics = trainer.train_step(rollouts)          # one optimizer step
        engine.load_weights(trainer.weights(dst=0))     # HF names, one full tensor at a time
    trainer.save()                                      # a DCP checkpoint; from_config resumes it
    trainer.close()

Every method is collective: every rank of the launch (`python -m titan_fold.run
--nproc_per_node N script.py`, or torchrun) calls it. A plain `python script.py` is a world of
one rank. Each batch rank passes its own records; the ranks of one tp or cp group pass the same.

A batch is a list of rollout records, dicts with the keys of the rollout files:
`tokens` (prompt + response ids), `loss_mask` (1 on response tokens), `advantages`, `logprobs`
(the behaviour policy's) and optionally `routed_experts`. `pack_rollouts` turns them into
the trainer's micro-batches: packed with document masking as chat SFT is, into the step's
local_batch_size x gradient-accumulation rows. The objective is the trainer's loss
(training.objective); the language-model loss trains on the loss_mask tokens.
"""

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_fold.checkpoint.stream import check_exportable, hf_weights
from titan_fold.checkpoint.stream import save_hub as save_hub_folder
from titan_fold.common.config import JobConfig, parse_args
from titan_fold.common.device import device_type
from titan_fold.common.errors import UserError
from titan_fold.data.dataset import DataError
from titan_fold.data.packing import PackedDocuments
from titan_fold.data.rollouts import RoutingShape, check_rollout, rollout_fields
from titan_fold.models.mtp import without_mtp
from titan_fold.moe import moe_layers
from titan_fold.moe.replay import record_routing
from titan_fold.trainer.fold_trainer import FoldTrainer, fit_warmup, lock_dump_folder
from titan_fold.trainer.logs import setup_logging
from titan_fold.trainer.preflight import preflight
from titan_fold.trainer.step import RECORDED_EXPERTS

Batch = Sequence[dict[str, Any]]


@dataclass
class Packed:
    """A batch as the trainer takes it: micro-batches [(input_dict, labels [b, s])], and where each
    record lies in them: (micro-batch, row, first position, length)."""

    microbatches: list[tuple[dict[str, torch.Tensor], torch.Tensor]]
    places: list[tuple[int, int, int, int]]


def pack_rollouts(
    records: Batch, shape: RoutingShape, seq_len: int, local_batch_size: int, microbatches: int
) -> Packed:
    """Rollout records -> the step's micro-batches of local_batch_size rows of seq_len tokens,
    each record checked as a rollout file's are (data/rollouts.py, against the model's `shape`)
    and packed whole with document masking, with its per-token fields (behaviour log-probs,
    advantages, routed_experts) beside its tokens; rows left over are padding."""
    documents = []
    for i, record in enumerate(records):
        try:
            documents.append(check_rollout(record, shape))
        except DataError as e:
            raise UserError(f"rollout record {i}: {e}") from None
        if (documents[-1].routed_experts is None) != (documents[0].routed_experts is None):
            raise UserError(f"rollout record {i}: either every record of a batch has 'routed_experts' or none")
    token_fields, fields = rollout_fields(documents, shape)
    packs = PackedDocuments(
        [(d.ids, d.trained) for d in documents], seq_len, "refuse", "rollouts", token_fields=token_fields, fields=fields
    )
    rows = local_batch_size * microbatches
    if len(packs.packs) > rows:
        raise UserError(
            f"{len(records)} rollout records pack into {len(packs.packs)} rows of training.seq_len = {seq_len} "
            f"tokens; a step on this rank holds {rows} (local_batch_size x gradient accumulation)"
        )
    samples = [packs[g] for g in range(len(packs.packs))]
    packs.packs.append([])  # a row of padding alone: no labels, its fields' padding values
    samples += [packs[len(packs.packs) - 1]] * (rows - len(samples))
    batches = []
    for m in range(microbatches):
        part = samples[m * local_batch_size : (m + 1) * local_batch_size]
        inputs = {k: torch.stack([s[0][k] for s in part]) for k in part[0][0]}
        batches.append((inputs, torch.stack([s[1] for s in part])))
    places: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(records)
    for row, pack in enumerate(packs.packs):
        start = 0
        for i in pack:
            n = len(packs.documents[i][0])
            places[i] = (row // local_batch_size, row % local_batch_size, start, n)
            start += n
    return Packed(batches, places)


def _single_process_env() -> None:
    """A plain `python script.py`: a world of one rank, as torchrun would describe it."""
    if "LOCAL_RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


@contextlib.contextmanager
def _statistics_kept(model_parts):
    """The MoE layers' statistics (aux-free counts, expert load) as they were before the block."""
    saved = [(m, m.stats.clone(), m.load.clone(), m.tokens_per_expert.clone()) for m in moe_layers(model_parts)]
    try:
        yield
    finally:
        for m, stats, load, tokens in saved:
            m.stats.copy_(stats)
            m.load.copy_(load)
            m.tokens_per_expert.copy_(tokens)


def _same_batch(a: Packed, b: Packed) -> bool:
    """Whether two packed batches hold the same tokens in the same places."""
    return len(a.microbatches) == len(b.microbatches) and all(
        torch.equal(x[0]["input"], y[0]["input"]) for x, y in zip(a.microbatches, b.microbatches, strict=True)
    )


class _RLFoldTrainer(FoldTrainer):
    """FoldTrainer whose every step reads its loss and gradient norm back (step_metrics)."""

    def _logs(self) -> bool:
        return True


class Trainer:
    """A FoldTrainer built and resumed as `python -m titan_fold.train` builds it, stepped by the caller."""

    def __init__(self, trainer: FoldTrainer, lock):
        self.trainer, self._lock = trainer, lock
        self._recorded: tuple[Packed, list] | None = None  # the last logprobs pass's batch and routing (R2)

    @classmethod
    def from_config(cls, config: str | JobConfig, overrides: Sequence[str] = ()) -> "Trainer":
        """config: a job config file (a packaged name or a path), as `--job.config_file`, with
        `--section.key value` overrides; or a parsed JobConfig. Checks the config, brings up the
        process group and both meshes, builds the model, optimizer and checkpoint manager, and
        loads the run's last checkpoint (or checkpoint.initial_load_path), as the trainer does."""
        setup_logging(device_type())
        if isinstance(config, str):
            config = parse_args(["--job.config_file", config, *overrides])
        elif overrides:
            raise UserError("overrides go with a config file; a JobConfig is taken as it is")
        _single_process_env()
        check_exportable(config.model.name, config.mtp.num_layers)
        preflight(config, int(os.environ["WORLD_SIZE"]))
        fit_warmup(config)
        lock = lock_dump_folder(config.job.dump_folder)
        trainer = _RLFoldTrainer(config)
        trainer.metrics_processor.begin()
        trainer.checkpointer.load(step=config.checkpoint.load_step)
        trainer.start()
        return cls(trainer, lock)

    @property
    def step(self) -> int:
        """Optimizer steps taken, counting those of the checkpoint it resumed."""
        return self.trainer.step

    def pack(self, batch: Batch) -> Packed:
        t = self.trainer
        config = t.job_config
        return pack_rollouts(
            batch,
            RoutingShape.of(t.model_args),
            config.training.seq_len,
            config.training.local_batch_size,
            t.gradient_accumulation_steps,
        )

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> list[torch.Tensor]:
        """Per record, log p(tokens[t] | tokens[:t]) under the current weights, [len(tokens)]
        float32 on the CPU; position 0 has no context and holds 0. No gradient, no change to the
        router's statistics (the aux-free bias counts and the logged expert load). Under
        moe.routing_replay = "recorded" (R2) it records each MoE layer's routing, and the next
        train_step on the same batch replays it, even if the weights changed in between."""
        t = self.trainer
        layout = t.parallel_dims
        if layout.pp > 1 or layout.cp > 1:
            raise UserError(
                f"logprobs: pipeline_parallel_degree = {layout.pp} and context_parallel_degree = {layout.cp}: both must be 1 for now"
            )
        packed = self.pack(batch)
        record = t.model_args.moe.routing_replay == "recorded"
        rows, recorded = [], []  # [b, s - 1] per micro-batch; its routing under R2
        with _statistics_kept(t.model_parts):
            for input_dict, labels in packed.microbatches:
                input_dict = {k: v.to(t.device) for k, v in input_dict.items()}
                inputs, _, extra_inputs, extra_kwargs = t.post_dataloading_process(input_dict, labels.to(t.device))
                with contextlib.ExitStack() as stack:
                    recording = stack.enter_context(record_routing(t.model_parts, inputs)) if record else None
                    stack.enter_context(t.train_context())
                    stack.enter_context(t.maybe_enable_amp)
                    logits = t.model_parts[0](inputs, **extra_inputs, **without_mtp(extra_kwargs))  # [b, s, vocab]
                if recording is not None:
                    recorded.append(recording.recorded)
                if isinstance(logits, DTensor):  # loss parallel: the vocabulary split over tp
                    logits = logits.full_tensor()
                lp = torch.log_softmax(logits.float(), dim=-1)
                # logits at t predict token t + 1
                rows.append(lp[:, :-1].gather(-1, inputs[:, 1:, None]).squeeze(-1).cpu())
        self._recorded = (packed, recorded) if record else None
        out = []
        for mb, row, start, n in packed.places:
            lp = torch.zeros(n)
            lp[1:] = rows[mb][row, start : start + n - 1]
            out.append(lp)
        return out

    def train_step(self, batch: Batch) -> dict[str, Any]:
        """One optimizer step on the batch -> its record as metrics.jsonl logs it (docs/metrics.md):
        step, loss (summed over the step's micro-batches and ranks), grad_norm, lr, tokens/s, the
        MoE statistics, the policy objective's ratio, clip fraction, log-prob gap and k3, and
        routing_replay_changed; a step the NaN/Inf guard skipped (training.nonfinite = 'skip')
        is {"step": N, "skipped": True}."""
        t = self.trainer
        packed = self.pack(batch)
        t.step += 1
        if t.gc_handler is not None:
            t.gc_handler.run(t.step)
        t.step_metrics = {}
        microbatches = packed.microbatches
        if self._recorded is not None and _same_batch(self._recorded[0], packed):
            # R2: replay the routing the logprobs pass recorded on this batch
            microbatches = [
                ({**inputs, RECORDED_EXPERTS: rec.routed_experts}, labels)
                for (inputs, labels), rec in zip(microbatches, self._recorded[1], strict=True)
            ]
        self._recorded = None
        t.train_step(t.batch_generator(iter(microbatches)))
        if not t.step_metrics:
            return {"step": t.step, "skipped": True}
        return {"step": t.step, **t.step_metrics}

    def weights(self, dst: int | None = None, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor), one at a time (checkpoint/stream.py): every rank runs
        it to the end; dst None: every rank gets every tensor, a rank: only that one does."""
        t = self.trainer
        pp_mesh = t.parallel_dims.get_optional_mesh("pp")
        return hf_weights(t.model_parts, t.model_args, t.job_config.model.name, pp_mesh, dst, dtype)

    def save_hub(self, folder: str, dtype: torch.dtype | None = None) -> None:
        """A Hub folder (config.json + safetensors) of the current weights; refuses a non-empty folder."""
        t = self.trainer
        pp_mesh = t.parallel_dims.get_optional_mesh("pp")
        save_hub_folder(t.model_parts, t.model_args, t.job_config.model.name, folder, pp_mesh, dtype)

    def save(self) -> str:
        """A full DCP checkpoint of this step (model, optimizer, lr schedule, data position),
        through the run's checkpoint manager -> its folder. from_config with the same
        job.dump_folder resumes it."""
        t = self.trainer
        if not t.checkpointer.enable:
            raise UserError("save: checkpoint.enable is off; turn it on to save and resume")
        t.checkpointer.save_now(t.step)
        return t.checkpointer.checkpoint_id(t.step)

    def close(self) -> None:
        """Ends the run: the checkpoint manager and metrics closed, the process group destroyed,
        the dump folder unlocked."""
        t = self.trainer
        if t.checkpointer.enable:
            t.checkpointer.wait_for_async_save()
        t.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        self._lock.release()
