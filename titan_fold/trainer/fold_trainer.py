"""The trainer of `torchrun -m titan_fold.train`: FoldTrainer and the run's main.

FoldTrainer builds a run from torchtitan's components and runs it, in this order:

    build   World.layout (world.py): process group and both meshes; the train spec
            (train_spec.py); tokenizer and dataloader (data/); the model on the meta device,
            split into pipeline stages (parallel/pipeline.py) and parallelized
            (parallel/parallelize.py), then materialized and initialized; the metrics
            (metrics.py); optimizers and lr schedulers (muon.py, optimizer.py, torchtitan's
            lr scheduler); the checkpoint manager (checkpoint/manager.py); the NaN/Inf guard
            (guard.py) and the rest of what the step uses
    step    TrainStep.train_step (step.py)
    loop    FoldTrainer.train: load, then step, save, profile until training.steps, a stop
            signal (signals.py) or the end of the data
    exit    main: the exit code of each way a run ends

MoE aux losses are normalized like the LM loss, and the aux-free router bias is updated after
each optimizer step. Everything that can be checked without a process group (config values,
degrees against the world size and the model, tokenizer against the vocabulary, dataset and
checkpoint paths) is checked in `preflight` (preflight.py) before the first collective; then
the dump folder is locked (lock.py). The dry run builds this same trainer through its seams
(the World it is given, the build_* methods it overrides: dryrun/step.py).
"""

import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any, NoReturn

import torch

# registers torchtitan's float8 and mx model converters (model.converters), as its train.py does
import torchtitan.components.quantization  # noqa: F401
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import utils as dist_utils
from torchtitan.protocols import train_spec as train_spec_module
from torchtitan.protocols.model_converter import build_model_converters
from torchtitan.tools import utils
from torchtitan.tools.logging import logger
from torchtitan.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling

from titan_fold.checkpoint.manager import FoldCheckpointManager
from titan_fold.checkpoint.saves import SaveError
from titan_fold.checkpoint.settings import run_settings
from titan_fold.common.config import JobConfig, parse_args
from titan_fold.common.device import device_type
from titan_fold.common.errors import UserError, is_first_rank, report
from titan_fold.common.moe_config import batch_overlap
from titan_fold.common.storage import StorageError, storage_problem, write_cause
from titan_fold.models.documents import document_lengths
from titan_fold.moe import update_expert_bias
from titan_fold.moe.layer import moe_stashes
from titan_fold.parallel.overlap import OverlapSchedule
from titan_fold.parallel.parallelize import cuda_graphs, mark_static_buffers, release_cuda_graphs
from titan_fold.parallel.pipeline import check_pipeline, sync_embedding_copies
from titan_fold.trainer.banner import banner as format_banner
from titan_fold.trainer.guard import NonFiniteError, NonFiniteGuard, check_weights
from titan_fold.trainer.lock import DumpFolderLock
from titan_fold.trainer.logs import setup_logging
from titan_fold.trainer.muon import MuonOptimizersContainer
from titan_fold.trainer.phases import StepPhases
from titan_fold.trainer.policy import PolicyLoss
from titan_fold.trainer.preflight import preflight
from titan_fold.trainer.shrink import shrink
from titan_fold.trainer.signals import PREEMPT, StopRequested, StopSignals, last_complete_checkpoint
from titan_fold.trainer.step import TrainStep
from titan_fold.trainer.train_spec import register_train_specs
from titan_fold.trainer.world import World, maybe_enable_amp


def lock_dump_folder(folder: str) -> DumpFolderLock:
    """Create the dump folder (checked by preflight; a fault since: one line) and lock it."""
    lock = DumpFolderLock(folder)
    if is_first_rank():
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise StorageError(f"job.dump_folder: cannot write {folder}: {write_cause(folder, e)}") from None
        lock.acquire()
    else:
        lock.check()
    return lock


def fit_warmup(config: JobConfig) -> None:
    """Warm up over at most training.steps steps: torchtitan's lr scheduler would shorten the
    warm-up itself while its trainer still reports the configured value."""
    warmup, steps = config.lr_scheduler.warmup_steps, config.training.steps
    if warmup > steps:
        logger.info(f"lr_scheduler.warmup_steps = {warmup} > training.steps = {steps}: warming up over {steps} steps")
        config.lr_scheduler.warmup_steps = steps


class FoldTrainer(TrainStep, Stateful):
    """A training run: built in __init__, run by train(), one step at a time (step.py).

    The one builder of a trainer, for real runs and the dry run alike. `world` says where it
    runs (world.py; default: this process's GPU or CPU and a new process group); the build_*
    methods build the parts a dry run's trainer leaves out or replaces (dryrun/step.py). Its
    checkpoint holds `train_state` (this object: step, ntokens_seen) beside the model,
    optimizer, lr_scheduler and dataloader, under torchtitan's Trainer's keys: checkpoints of
    either load in the other."""

    guard_class = NonFiniteGuard

    def __init__(self, job_config: JobConfig, stop_signals: StopSignals | None = None, world: World | None = None):
        register_train_specs()
        self.job_config = job_config
        self.world = world or World.of_this_process()
        logger.info(f"Starting job: {job_config.job.description}")
        if job_config.experimental.custom_import:
            importlib.import_module(job_config.experimental.custom_import)

        # meshes
        self.device = self.world.device
        self.world.enter()
        self.parallel_dims = layout = self.world.layout(job_config)
        job_config.maybe_log()
        batch_degree, batch_rank = (
            (layout.get_mesh("batch").size(), layout.get_mesh("batch").get_local_rank())
            if layout.dp_enabled
            else (1, 0)
        )
        self.gc_handler = self.build_gc_handler()
        self.seed()
        self.train_spec = spec = self.build_train_spec()

        # data (rollouts are checked against the model's args: its experts and MoE layers)
        self.model_args = model_args = spec.model_args[job_config.model.flavor]
        model_args.update_from_config(job_config)
        self.tokenizer = spec.build_tokenizer_fn(job_config) if spec.build_tokenizer_fn is not None else None
        self.dataloader = (
            spec.build_dataloader_fn(
                dp_world_size=batch_degree,
                dp_rank=batch_rank,
                tokenizer=self.tokenizer,
                job_config=job_config,
                model_args=model_args,
            )
            if spec.build_dataloader_fn is not None
            else None
        )

        # model, on the meta device
        logger.info(
            f"Building {job_config.model.name} {job_config.model.flavor} with "
            f"{json.dumps(dataclasses.asdict(model_args), indent=2, ensure_ascii=False)}"
        )
        with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]):
            model = spec.model_cls(model_args)
        self.model_converters = build_model_converters(job_config, layout)
        self.model_converters.convert(model)

        # metrics
        self.metrics_processor = spec.build_metrics_processor_fn(job_config, layout, model_args)
        color = self.metrics_processor.color
        seq_len = job_config.training.seq_len
        n_params, flops_per_token = model_args.get_nparams_and_flops(model, seq_len)
        # MFU counts each batch's attention as computed (batch_flops): less the full sequence's here
        self.dense_flops_per_token = flops_per_token - model_args.attention_flops([seq_len]) / seq_len
        logger.info(
            f"{color.blue}Model {job_config.model.name} {job_config.model.flavor} "
            f"{color.red}size: {n_params:,} total parameters{color.reset}"
        )
        self.loss_fn = spec.build_loss_fn(job_config, parallel_dims=layout)
        if isinstance(self.loss_fn, PolicyLoss):  # training.objective = "policy": its metrics
            self.metrics_processor.policy_stats = self.loss_fn.stats
        self.gradient_accumulation_steps = accumulation_steps(job_config, batch_degree)

        # parallelize (and split into pipeline stages), then materialize and initialize
        self.model_parts = self.build_model_parts(model)
        peak = self.metrics_processor.device_memory_monitor.get_peak_stats()
        logger.info(
            f"{self.device.type.upper()} memory usage for model: "
            f"{peak.max_reserved_gib:.2f}GiB({peak.max_reserved_pct:.2f}%)"
        )

        # optimizer and lr schedule
        self.optimizers = spec.build_optimizers_fn(self.model_parts, job_config.optimizer, layout)
        self.lr_schedulers = spec.build_lr_schedulers_fn(
            self.optimizers, job_config.lr_scheduler, job_config.training.steps
        )
        self.metrics_processor.optimizers = self.optimizers
        self.metrics_processor.model_parts = self.model_parts

        # checkpoint: the train state is set before a load can replace it
        self.step = 0
        self.ntokens_seen = 0
        self.checkpointer = self.build_checkpointer()
        if isinstance(self.checkpointer, FoldCheckpointManager) and self.checkpointer.enable:
            # saved beside every checkpoint: what a resume compares (preflight.check_resume)
            self.checkpointer.settings = run_settings(job_config, self.tokenizer, layout.dp)

        # the step's context: loss parallel under tp, the compute dtype in every layout
        self.train_context = dist_utils.get_train_context(
            layout.tp_enabled and not job_config.parallelism.disable_loss_parallel
        )
        self.maybe_enable_amp = maybe_enable_amp(layout, job_config.training.mixed_precision_param, self.device.type)
        self.build_step_parts(stop_signals)
        logger.info(
            f"Trainer is initialized with local batch size {job_config.training.local_batch_size}, "
            f"global batch size {job_config.training.local_batch_size * batch_degree * self.gradient_accumulation_steps}, "
            f"gradient accumulation steps {self.gradient_accumulation_steps}, "
            f"sequence length {job_config.training.seq_len}, total steps {job_config.training.steps} "
            f"(warmup {job_config.lr_scheduler.warmup_steps})"
        )

    # ---- the parts a dry run's trainer builds otherwise (dryrun/step.py)

    def build_gc_handler(self) -> utils.GarbageCollection | None:
        """torchtitan's: automatic garbage collection off, a collection every training.gc_freq steps."""
        return utils.GarbageCollection(
            gc_freq=self.job_config.training.gc_freq, debug=self.job_config.training.gc_debug
        )

    def seed(self) -> None:
        """debug.seed (or rank 0's) on every rank, distinct per pipeline stage; debug.deterministic."""
        dist_utils.set_determinism(
            self.parallel_dims, self.device, self.job_config.debug, distinct_seed_mesh_dims=["pp"]
        )

    def build_train_spec(self) -> train_spec_module.TrainSpec:
        return train_spec_module.get_train_spec(self.job_config.model.name)

    def build_checkpointer(self) -> FoldCheckpointManager:
        spec, config = self.train_spec, self.job_config
        return FoldCheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            checkpoint_config=config.checkpoint,
            sd_adapter=(
                spec.state_dict_adapter(self.model_args, config.model.hf_assets_path)
                if spec.state_dict_adapter
                else None
            ),
            base_folder=config.job.dump_folder,
        )

    # ---- the build's steps

    def build_model_parts(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The meta model parallelized (under pp: this rank's stages, and the pipeline schedule),
        then materialized (on the CPU for a seed checkpoint) and initialized. -> the model parts."""
        config, layout, spec = self.job_config, self.parallel_dims, self.train_spec
        init_device = "cpu" if config.checkpoint.create_seed_checkpoint else self.device.type
        if layout.pp_enabled:
            self.pp_schedule, parts, self.pp_has_first_stage, self.pp_has_last_stage = spec.pipelining_fn(
                model, layout, config, self.device, self.model_args, spec.parallelize_fn, self.loss_fn
            )
        else:
            parts = [spec.parallelize_fn(model, layout, config)]
        for part in parts:
            part.to_empty(device=init_device)
            with torch.no_grad():
                part.init_weights()
            part.train()
        return parts

    def build_step_parts(self, stop_signals: StopSignals | None) -> None:
        """The guard and what else the step uses besides the model and the optimizers."""
        config = self.job_config
        # NaN/Inf in the loss or gradient norm: stop or skip with the weights untouched (guard.py)
        self.guard = self.guard_class(config.training.nonfinite, self.device)
        self.guard.watch(self.optimizers)
        self.cudagraphs = cuda_graphs(config)
        if self.cudagraphs:
            mark_static_buffers(self.model_parts)
        # moe.stash_rows: the stashes' overflow is checked there too
        self.guard.stashes, self.guard.stash_rows = moe_stashes(self.model_parts), self.model_args.moe.stash_rows
        if self.model_args.mtp_layers and self.parallel_dims.pp > 1:
            # the last stage's embedding copy starts as the first stage's (a checkpoint loads both)
            sync_embedding_copies(self.model_parts, self.parallel_dims.get_mesh("pp"), "weights")
        # moe.ep_overlap "batch": micro-batches overlapped in pairs (parallel/overlap.py); under pp the
        # pipeline schedule pairs them (pipeline.py)
        self.overlap = (
            OverlapSchedule(
                self.model_parts[0], self.gradient_accumulation_steps, self.train_context, lambda: self.maybe_enable_amp
            )
            if batch_overlap(self.model_args.moe.ep_overlap) and not self.parallel_dims.pp_enabled
            else None
        )
        self.stop_signals = stop_signals or StopSignals()
        self.start_step = 0  # start() sets it
        self.expert_bias_update = None
        if self.model_args.moe.load_balance == "aux_free":
            # the router bias follows the expert load of every token this stage routed
            stage_mesh = self.parallel_dims.get_optional_mesh("stage")
            group = stage_mesh.get_group() if stage_mesh is not None else None

            def all_reduce(t: torch.Tensor) -> torch.Tensor:
                if group is not None:
                    torch.distributed.all_reduce(t, group=group)
                return t

            self.expert_bias_update = functools.partial(update_expert_bias, self.model_parts, all_reduce)
        # metrics.group_grad_norms: a logged step's norms per parameter group (step.py)
        self.group_grad_norms = None
        # metrics.step_phases: host and GPU time per phase of each logged step (phases.py)
        self.phases = StepPhases(self.device) if config.metrics.step_phases else None
        if self.phases is not None:
            self._mark_phases(self.phases)

    def _mark_phases(self, phases: StepPhases) -> None:
        """The one phase boundary the step's methods do not mark, as a hook: the model's forward
        ends (where forward and backward do not interleave)."""
        interleaved = self.parallel_dims.pp_enabled or self.overlap is not None
        self._forward_phase = "forward_backward" if interleaved else "forward"
        if not interleaved:
            for part in self.model_parts:
                part.register_forward_hook(lambda *args: phases.mark("backward"))
        self.metrics_processor.phases = phases

    def banner(self) -> str:
        """What a real run prints once at start (banner.py)."""
        pp = self.parallel_dims.pp
        stages = len(check_pipeline(self.job_config, self.model_args, pp)[1]) if pp > 1 else 1
        split = self.optimizers.split() if isinstance(self.optimizers, MuonOptimizersContainer) else None
        return format_banner(self.parallel_dims, self.model_args, self.model_parts, self.job_config, stages, split)

    # ---- the loop

    @record
    def train(self) -> None:
        """From the last checkpoint (if any) to training.steps: step, save, profile. A stop
        signal or NaN/Inf stop raises (signals.py, guard.py); the end of the data ends the loop."""
        config = self.job_config
        # built for every run but a dry run, which does not train (dryrun/step.py)
        assert self.dataloader is not None and self.gc_handler is not None
        self.metrics_processor.begin()
        self.checkpointer.load(step=config.checkpoint.load_step)
        self.start()
        logger.info(f"Training starts at step {self.step + 1}")
        profiling = dict(global_step=self.step, base_folder=config.job.dump_folder)
        with (
            maybe_enable_profiling(config.profiling, **profiling) as torch_profiler,
            maybe_enable_memory_snapshot(config.profiling, **profiling) as memory_profiler,
        ):
            data_iterator = self.batch_generator(self.dataloader)
            while self.should_continue_training():
                self.step += 1
                self.gc_handler.run(self.step)
                try:
                    self.train_step(data_iterator)
                except DataloaderExhaustedError:
                    logger.warning("Ran out of data; last step was canceled.")
                    break
                self.checkpointer.save(self.step, last_step=self.step == config.training.steps)
                for profiler in (torch_profiler, memory_profiler):
                    if profiler:
                        profiler.step()
                if self.step == 1:  # compiled and warmed up: later collectives fail sooner
                    timeout = timedelta(seconds=config.comm.train_timeout_seconds)
                    self.world.set_pg_timeouts(timeout, self.parallel_dims)
        if torch.distributed.get_rank() == 0:
            logger.info("Training completed")
        last = last_complete_checkpoint(self.checkpointer.folder) if self.checkpointer.enable else None
        checkpoint = os.path.join(self.checkpointer.folder, last) if last else None
        saved = self.checkpointer.last_saved if self.checkpointer.enable else None
        if saved and saved[0] == self.step:  # this run's last save (an HF export has no DCP metadata)
            checkpoint = self.checkpointer.describe_save(*saved)
        self.metrics_processor.summary(checkpoint)
        if truncated := getattr(self.dataloader.dataset, "truncated", 0):
            logger.info(
                f"  data: {truncated} documents longer than training.seq_len were cut to it (training.long_documents)"
            )

    def batch_generator(self, batches: Iterable) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """The dataloader's (input_dict, labels), left on the host, counted as they come: the
        tokens seen, the tokens since the last logged step, the time each took to load. A step
        the data runs out in raises DataloaderExhaustedError: it is not run."""
        batches = iter(batches)
        while True:
            begin = time.perf_counter()
            try:
                input_dict, labels = next(batches)
            except StopIteration as e:
                raise DataloaderExhaustedError() from e
            self.ntokens_seen += labels.numel()
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            self.metrics_processor.flops_since_last_log += self.batch_flops(input_dict, labels)
            self.metrics_processor.data_loading_times.append(time.perf_counter() - begin)
            yield input_dict, labels

    def batch_flops(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> float:
        """The training FLOPs MFU counts for a batch [b, s]: 6 * N_active per token, and causal
        attention within each packed document (training.document_masking), else over each sample."""
        ids = input_dict.get("document_ids")
        lengths = document_lengths(ids) if ids is not None else torch.full(labels.shape[:1], labels.shape[1])
        return self.dense_flops_per_token * labels.numel() + self.model_args.attention_flops(lengths)

    def start(self) -> None:
        """Once the checkpoint (if any) is loaded, before the first step: the step it starts from,
        the weights checked for NaN/Inf, the metrics file from that step on."""
        self.start_step = self.step
        self.check_loaded_weights()
        if self.metrics_processor.jsonl:
            self.metrics_processor.jsonl.start(self.step)

    def should_continue_training(self) -> bool:
        """Called before every step; also where a stop request is agreed on by every rank."""
        if self.step >= self.job_config.training.steps:
            return False
        kind = self.stop_signals.agreed(self.device)
        if kind:
            if kind == PREEMPT and self.checkpointer.enable and self.step > self.start_step:
                self.checkpointer.save_now(self.step)
            raise StopRequested(kind, self.step)
        return True

    def check_loaded_weights(self) -> None:
        ckpt = self.job_config.checkpoint
        if self.step > 0:
            where = f"checkpoint {os.path.join(self.checkpointer.folder, f'step-{self.step}')}"
        elif ckpt.initial_load_path:
            where = f"checkpoint.initial_load_path {ckpt.initial_load_path}"
        else:
            where = "the initial weights"
        check_weights(self.model_parts, where)

    # ---- the checkpoint's train_state, and the end

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics_processor.close()


def accumulation_steps(job_config: JobConfig, batch_degree: int) -> int:
    """Micro-batches per step: training.global_batch_size (-1: one micro-batch per batch rank)
    over local_batch_size x the batch ranks (preflight checked that it divides)."""
    per_micro_batch = job_config.training.local_batch_size * batch_degree
    global_batch = job_config.training.global_batch_size
    return global_batch // per_micro_batch if global_batch > 0 else 1


def checkpoint_folder(config: JobConfig) -> str:
    return os.path.join(config.job.dump_folder, config.checkpoint.folder)


def last_checkpoint_text(config: JobConfig) -> str:
    if not config.checkpoint.enable:
        return "checkpointing is off (checkpoint.enable)"
    folder = checkpoint_folder(config)
    last = last_complete_checkpoint(folder)
    return f"last complete checkpoint {last} in {folder}" if last else f"no complete checkpoint in {folder}"


def say(line: str) -> None:
    if is_first_rank():
        print(line, file=sys.stderr, flush=True)


def main(args: list[str] | None = None, dry_run: Callable[[JobConfig], int] | None = None) -> int:
    """`dry_run(config)` runs instead of training when `--comm.mode` is not "default".
    Exit codes: 0 done, 2 bad input (one line), 3 NaN/Inf stop, 130 Ctrl-C, 143 SIGTERM/SIGUSR1
    (after a save). Anything else is a bug or a fault and keeps its traceback."""
    setup_logging(device_type())
    stop_signals = StopSignals()
    stop_signals.install()  # from here a signal only sets a flag, read at the end of each step
    trainer, lock, config, clean = None, None, None, False
    try:
        config = parse_args(args)
        if config.debug.shrink:  # before every check: they check the small run
            ranks = os.environ.get("NGPU" if config.comm.mode == "fake_backend" else "WORLD_SIZE", "1")
            for line in shrink(config, int(ranks)):
                say(line)
        if config.comm.mode != "default":
            # torchtitan's dry run (NGPU fake ranks in one process): titan_fold's own (dryrun/)
            if dry_run is None:
                raise UserError(f"comm.mode = {config.comm.mode!r}: start it with python -m titan_fold.train")
            return dry_run(config)
        preflight(config, int(os.environ.get("WORLD_SIZE", "1")))
        fit_warmup(config)
        if "LOCAL_RANK" not in os.environ:
            raise UserError(
                "start the trainer with its launcher: python -m titan_fold.run --nproc_per_node N ... "
                "(or torchrun --nproc_per_node N -m titan_fold.train ...)"
            )
        # last of the checks, so a rejected run leaves no folder behind
        lock = lock_dump_folder(config.job.dump_folder)
        trainer = FoldTrainer(config, stop_signals)
        if torch.distributed.get_rank() == 0:
            logger.info(trainer.banner())
        if config.checkpoint.create_seed_checkpoint:  # preflight checked the rank count and checkpoint.enable
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
        clean = True
        return 0
    except SaveError as e:  # raised on every rank (checkpoint/manager.py)
        assert config is not None  # this and the next two come from a trainer: the config was parsed
        report(StorageError(f"{e}; {last_checkpoint_text(config)}"))
        return e.exit_code
    except UserError as e:
        report(e)  # one line, also in torchrun's error file in place of the traceback
        return e.exit_code
    except NonFiniteError as e:
        assert config is not None
        clean = True  # every rank raised it at the same step
        say(
            f"error: {e}; stopped before the optimizer step, nothing saved from it; {last_checkpoint_text(config)} "
            f"(training.nonfinite = 'skip' skips such steps instead)"
        )
        return e.exit_code
    except StopRequested as e:
        assert config is not None
        clean = True
        what = "interrupted" if e.exit_code == 130 else f"stopped by {stop_signals.name or 'a signal'}"
        say(f"{what} at step {e.step}; {last_checkpoint_text(config)}")
        return e.exit_code
    except Exception:
        problem = storage_problem(config.job.dump_folder) if config is not None and lock is not None else None
        if problem is None:
            raise
        report(StorageError(problem))
        return StorageError.exit_code
    finally:
        if trainer is not None:
            if clean and trainer.checkpointer.enable:
                trainer.checkpointer.wait_for_async_save()
            trainer.close()
        if torch.distributed.is_initialized():
            if clean:
                # no rank closes its connections while a peer still uses them
                torch.distributed.barrier()
            if config is not None:
                release_cuda_graphs(config)
            torch.distributed.destroy_process_group()
        if lock is not None:
            lock.release()


def end_process(code: int) -> NoReturn:
    """How `python -m titan_fold.train` ends once main has returned: os._exit, after a flush.

    destroy_process_group leaves a gloo process group running (its worker and socket threads,
    its connections) while anything holds it, and the meshes do. torchtitan turns automatic
    garbage collection off, so the group would go in the interpreter's final collection or
    in C++'s static destructors at exit(), in no defined order, while its threads still run
    and the peers' exits close its sockets. That teardown also resets the signal handlers:
    the SIGTERM torchrun sends the ranks still running once one rank has exited non-zero
    would kill them (-15) in place of their own exit code. By now every rank that ended
    cleanly has passed the barrier, and the lock is released: nothing is left to do."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream
            stream.flush()
    os._exit(code)
