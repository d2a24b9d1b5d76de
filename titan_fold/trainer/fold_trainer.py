"""The trainer of `torchrun -m titan_fold.train`: FoldTrainer and the run's main.

FoldTrainer is torchtitan 0.2.2's Trainer with the folded layout as its parallel dims,
MoE aux losses normalized like the LM loss, and the aux-free router bias updated after
each optimizer step. Everything that can be checked without a process group (config
values, degrees against the world size and the model, tokenizer against the vocabulary,
dataset and checkpoint paths) is checked in `preflight` (preflight.py) before the first collective; then
the dump folder is locked (lock.py). During training a NaN/Inf loss or gradient norm stops
or skips the step (guard.py) and signals stop every rank after the same step (signals.py).
"""

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from titan_fold.checkpoint.manager import FoldCheckpointManager
from titan_fold.checkpoint.saves import SaveError, maybe_fault
from titan_fold.checkpoint.settings import run_settings
from titan_fold.common.config import JobConfig, parse_args
from titan_fold.common.device import device_type
from titan_fold.common.errors import UserError, is_first_rank, report
from titan_fold.common.storage import StorageError, storage_problem
from titan_fold.common.tensors import to_device
from titan_fold.models.groups import GROUPS, parameter_group
from titan_fold.models.mtp import future_tokens, mtp_modules
from titan_fold.moe import moe_layers, update_expert_bias
from titan_fold.moe.layer import moe_stashes
from titan_fold.moe.wgrad import flush_wgrad
from titan_fold.parallel.attention import cp_shard
from titan_fold.parallel.clip import clip_grad_norm_, divides_by_grad_scale, group_norm_values, group_norms
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.overlap import OverlapSchedule, overlap_forward_backward
from titan_fold.parallel.parallelize import _plan_fqn, cuda_graphs, mark_static_buffers, release_cuda_graphs
from titan_fold.parallel.pipeline import (
    check_pipeline,
    embedding_copies,
    pipeline_forward_backward,
    sync_embedding_copies,
)
from titan_fold.trainer.banner import banner as format_banner
from titan_fold.trainer.guard import NonFiniteError, NonFiniteGuard, SkippedStep, check_weights
from titan_fold.trainer.lock import DumpFolderLock
from titan_fold.trainer.logs import setup_logging
from titan_fold.trainer.muon import MuonOptimizersContainer
from titan_fold.trainer.phases import StepPhases
from titan_fold.trainer.preflight import layout_from_config, preflight
from titan_fold.trainer.signals import PREEMPT, StopRequested, StopSignals, last_complete_checkpoint
from titan_fold.trainer.torchtitan_adapter import init_distributed, trainer_names, with_names
from titan_fold.trainer.train_spec import register_train_specs


def lock_dump_folder(folder: str) -> DumpFolderLock:
    """Create the dump folder (a missing parent, a read-only or full disk: one line) and lock it."""
    lock = DumpFolderLock(folder)
    if is_first_rank():
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise StorageError(f"job.dump_folder: cannot create {folder}: {e.strerror or e}") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise StorageError(f"job.dump_folder: {folder} is not writable")
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


class FoldTrainer(Trainer):
    """torchtitan's Trainer; its __init__ and train run as torchtitan wrote them, with the names
    torchtitan_adapter.py lists resolved to titan_fold's (device, mixed precision, checkpoint
    manager, timeouts). Its train_step is torchtitan's without waits for the device (_train_step).

    The one builder of a trainer, for real runs and the dry run alike: a dry run's trainer
    (dryrun/record.py) is this class, with its own `torchtitan_names` (no tokenizer, data,
    checkpoints or metrics files), `guard_class` and `init_distributed`."""

    guard_class = NonFiniteGuard

    def init_distributed(self) -> Layout:
        world_size = init_distributed(self.job_config.comm, base_folder=self.job_config.job.dump_folder)
        layout = layout_from_config(self.job_config, world_size)
        layout.build_mesh()
        return layout

    def torchtitan_names(self) -> dict:
        """The names torchtitan's Trainer code sees in place of its module globals."""
        return trainer_names()

    def _torchtitan(self, method):
        return with_names(method, **self._names).__get__(self)

    def __init__(self, job_config: JobConfig, stop_signals: StopSignals | None = None):
        register_train_specs()
        self._names = self.torchtitan_names()
        self._torchtitan(Trainer.__init__)(job_config)
        # NaN/Inf in the loss or gradient norm: stop or skip with the weights untouched (guard.py)
        self.guard = self.guard_class(job_config.training.nonfinite, self.device)
        self.guard.watch(self.optimizers)
        # a logged step's values reach the host beside the guard's verdict (host_copies.py): the
        # MoE statistics queued here, before the optimizer's kernels; the loss and the gradient
        # norm where they are computed
        self.optimizers.register_step_pre_hook(
            lambda *args, **kwargs: self.metrics_processor.stage(self.guard.copies.copy) if self._logs() else None
        )
        self.cudagraphs = cuda_graphs(job_config)
        if self.cudagraphs:
            mark_static_buffers(self.model_parts)
        # moe.stash_rows: the stashes' overflow is checked there too
        self.guard.stashes, self.guard.stash_rows = moe_stashes(self.model_parts), self.model_args.moe.stash_rows
        if self.model_args.mtp_layers and self.parallel_dims.pp > 1:
            # the last stage's embedding copy starts as the first stage's (a checkpoint loads both)
            sync_embedding_copies(self.model_parts, self.parallel_dims.get_mesh("pp"), "weights")
        # moe.overlap_ep_comm: micro-batches overlapped in pairs (parallel/overlap.py); under pp the
        # pipeline schedule pairs them (pipeline.py)
        self.overlap = (
            OverlapSchedule(
                self.model_parts[0], self.gradient_accumulation_steps, self.train_context, lambda: self.maybe_enable_amp
            )
            if self.model_args.moe.overlap_ep_comm and not self.parallel_dims.pp_enabled
            else None
        )
        self.stop_signals = stop_signals or StopSignals()
        self.start_step = None
        if isinstance(self.checkpointer, FoldCheckpointManager) and self.checkpointer.enable:
            # saved beside every checkpoint: what a resume compares (preflight.check_resume)
            self.checkpointer.settings = run_settings(job_config, self.tokenizer, self.parallel_dims.dp)
        if self.model_args.moe.load_balance == "aux_free":
            # the expert load of every token this stage routed
            stage_mesh = self.parallel_dims.get_optional_mesh("stage")
            group = stage_mesh.get_group() if stage_mesh is not None else None

            def all_reduce(t: torch.Tensor) -> torch.Tensor:
                if group is not None:
                    torch.distributed.all_reduce(t, group=group)
                return t

            self.optimizers.register_step_post_hook(
                lambda *args, **kwargs: update_expert_bias(self.model_parts, all_reduce)
            )
        # metrics.group_grad_norms: a logged step's norms per parameter group (_group_norms)
        self.group_grad_norms = None
        # metrics.step_phases: host and GPU time per phase of each logged step (phases.py)
        self.phases = StepPhases(self.device) if job_config.metrics.step_phases else None
        if self.phases is not None:
            self._mark_phases(self.phases)

    def _mark_phases(self, phases: StepPhases) -> None:
        """The phase boundaries this class does not mark in its own methods, as hooks: the model's
        forward ends (where forward and backward do not interleave), the optimizers' step starts
        and ends (after the guard's and the aux-free bias's hooks)."""
        interleaved = self.parallel_dims.pp_enabled or self.overlap is not None
        self._forward_phase = "forward_backward" if interleaved else "forward"
        if not interleaved:
            for part in self.model_parts:
                part.register_forward_hook(lambda *args: phases.mark("backward"))
        self.optimizers.register_step_pre_hook(lambda *args, **kwargs: phases.mark("optimizer"))
        self.optimizers.register_step_post_hook(lambda *args, **kwargs: phases.mark("rest"))
        self.metrics_processor.phases = phases

    def banner(self) -> str:
        """What a real run prints once at start (banner.py)."""
        pp = self.parallel_dims.pp
        stages = len(check_pipeline(self.job_config, self.model_args, pp)[1]) if pp > 1 else 1
        split = self.optimizers.split() if isinstance(self.optimizers, MuonOptimizersContainer) else None
        return format_banner(self.parallel_dims, self.model_args, self.model_parts, self.job_config, stages, split)

    def post_dataloading_process(self, input_dict, labels):
        # torchtitan's version would apply torch's context_parallel; ours shards the batch
        inputs = input_dict["input"]
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        extra_kwargs = {}
        layout = self.parallel_dims
        future = future_tokens(labels, self.model_args.mtp_layers) if self.model_args.mtp_layers else None
        if layout.cp > 1:
            # load-balanced causal split; the model needs the global positions for RoPE
            inputs, labels, extra_kwargs["positions"] = cp_shard(inputs, labels, layout.attention["cp"])
            if future is not None:  # taken before the split: tokens ahead may sit in another rank's chunk
                future = future.index_select(1, extra_kwargs["positions"])
        if future is not None:
            extra_kwargs["future_tokens"] = future
        return inputs, labels, extra_inputs, extra_kwargs

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self.phases is not None:
            self.phases.mark(self._forward_phase)
        loss = self._forward_backward(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        self.guard.observe_loss(loss)
        if self.phases is not None:
            self.phases.mark("data")  # the next micro-batch to the device
        # the step (_train_step) reads the loss with .item() after the optimizer step, except
        # under dp or cp, where it reduces the device value over the ranks first
        return loss if self.parallel_dims.dp_cp_enabled or not self._logs() else self.guard.copies.copy(loss)

    def _logs(self) -> bool:
        return self.metrics_processor.should_log(self.step)

    def _forward_backward(self, *, input_dict, labels, global_valid_tokens):
        for mtp in mtp_modules(self.model_parts):
            # a token sum like the LM loss: one scale for every micro-batch of the step
            mtp.loss_scale = (1.0 / torch.as_tensor(global_valid_tokens, dtype=torch.float32)).to(mtp.loss_scale.device)
        if self.parallel_dims.pp_enabled:
            loss = pipeline_forward_backward(
                self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        elif self.overlap is not None:
            loss = overlap_forward_backward(
                self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        else:
            # aux losses are token means over this micro-batch's sequences (the router gathers
            # their statistics over cp x tp); weigh them like the LM loss, whose sum is divided
            # by the global token count. `labels` is still the whole micro-batch here.
            scale = (labels != IGNORE_INDEX).sum() / global_valid_tokens
            for moe in moe_layers(self.model_parts):
                moe.aux_loss_scale.fill_(scale)
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        flush_wgrad(self.model_parts)  # weight gradients still queued (moe.delay_wgrad_compute)
        maybe_fault(self.step)  # tests: a rank killed in the middle of a step
        return loss

    def clip_grad_norm(self, parameters, *args, **kwargs) -> torch.Tensor:
        """The step's clipping (_train_step, as torchtitan's clip_grad_norm_): gradients on two
        meshes, the coefficient applied by fused optimizers (parallel/clip.py); the norm is
        handed to the NaN/Inf guard. Under pp with MTP layers the last stage's embedding copy
        takes the first stage's gradient too and is left out of the norm (counted once)."""
        if self.phases is not None:
            self.phases.mark("clip")
        copies = []
        if self.model_args.mtp_layers and self.parallel_dims.pp > 1:
            sync_embedding_copies(self.model_parts, self.parallel_dims.get_mesh("pp"), "grads")
            copies = embedding_copies(self.model_parts)
        skip = {id(p) for p in copies}
        parameters = [p for p in parameters if id(p) not in skip]
        if self.job_config.metrics.group_grad_norms and self._logs():  # before the clip scales them
            self.group_grad_norms = self.guard.copies.copy(
                self._group_norms((name, p.grad) for name, p in self._named_parameters() if p.grad is not None)
            )
        norm = clip_grad_norm_(parameters, *args, optimizers=self.optimizers.optimizers, **kwargs)
        if copies and not all(divides_by_grad_scale(o) for o in self.optimizers.optimizers):
            torch.nn.utils.clip_grads_with_norm_(copies, args[0] if args else kwargs["max_norm"], norm)
        self.guard.observe_grad_norm(norm)
        return self.guard.copies.copy(norm) if self._logs() else norm  # read with .item() at a logged step

    @record
    def train(self):
        self.metrics_processor.begin()
        self._torchtitan(Trainer.train)()
        last = last_complete_checkpoint(self.checkpointer.folder) if self.checkpointer.enable else None
        checkpoint = os.path.join(self.checkpointer.folder, last) if last else None
        saved = self.checkpointer.last_saved if self.checkpointer.enable else None
        if saved and saved[0] == self.step:  # this run's last save (an HF export has no DCP metadata)
            checkpoint = self.checkpointer.describe_save(*saved)
        self.metrics_processor.summary(checkpoint)

    def train_step(self, data_iterator):
        self.guard.step = self.step
        if self.phases is not None and self.metrics_processor.should_log(self.step):
            self.phases.start()
        if self.cudagraphs:
            # CUDA graph trees take this, and only this, for the start of a step. Left to guess,
            # they start one at any torch.compile call outside their graphs (a fused() kernel in
            # eager code between compiled blocks) and free graph outputs that backward still needs.
            torch.compiler.cudagraph_mark_step_begin()
        try:
            self._train_step(data_iterator)
        except SkippedStep as e:
            logger.warning(
                f"step {self.step}: {e.what}: step skipped (training.nonfinite = 'skip'; "
                f"{self.guard.skipped} skipped so far)"
            )
            if self.metrics_processor.jsonl:
                self.metrics_processor.jsonl.write(
                    {"step": self.step, "skipped": e.what, "skipped_steps": self.guard.skipped}
                )

    def _train_step(self, data_iterator):
        """torchtitan's Trainer.train_step with nothing in it that waits for the device before the
        update is queued. torchtitan moves the batches and their token count with blocking copies
        and sums the count over the batch ranks on the host, and under dp or cp reads the logged
        loss's reductions over the ranks on the host after the update is queued: each waits for
        the work queued before it (the step before's or this step's update), and the device then
        idles while the host queues the next kernels. Here the count is summed on the device,
        every copy to the device is queued behind the work there (common/tensors.py: to_device),
        and the logged values reach the host by copies queued before the update (_logged_values)."""
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        layout = self.parallel_dims
        # the micro-batches stay on the host until their turn; their tokens are counted there
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        local_valid_tokens = to_device(
            torch.stack([(labels != IGNORE_INDEX).sum() for _, labels in microbatches]).sum(), self.device
        )
        global_valid_tokens = local_valid_tokens.float()
        if layout.dp_enabled:
            global_valid_tokens = funcol.all_reduce(local_valid_tokens, "sum", layout.get_mesh("batch")).float()
        losses = []
        for input_dict, labels in microbatches:
            input_dict = {
                k: to_device(v, self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()
            }
            loss = self.forward_backward_step(
                input_dict=input_dict, labels=to_device(labels, self.device), global_valid_tokens=global_valid_tokens
            )
            losses.append(loss.detach())
        grad_norm = self.clip_grad_norm(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
            pp_mesh=layout.get_optional_mesh("pp"),
            ep_enabled=layout.ep_enabled,
        )
        logs = self.metrics_processor.should_log(self.step)
        read = self._logged_values(losses, global_valid_tokens, local_valid_tokens) if logs else None
        self.checkpointer.maybe_wait_for_staging()
        before = self._weights() if logs and self.group_grad_norms is not None else None
        self.optimizers.step()
        self.lr_schedulers.step()
        if logs:  # the guard's wait, once the update was queued, has brought the values
            avg_loss, max_loss, ntokens_seen = read()
            extra = {"n_tokens_seen": ntokens_seen, "lr": lr}
            if before is not None:
                extra.update(self._group_norm_metrics(before))
            self.metrics_processor.log(self.step, avg_loss, max_loss, grad_norm.item(), extra_metrics=extra)

    def _named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters by their names in the model (without the wrappers of compile and
        activation checkpointing), less the MTP layers' embedding copy under pp (counted on the
        first stage, as in the gradient norm)."""
        skip = {id(p) for p in embedding_copies(self.model_parts)}
        return [
            (_plan_fqn(name), p)
            for part in self.model_parts
            for name, p in part.named_parameters()
            if id(p) not in skip
        ]

    def _group_norms(self, tensors) -> torch.Tensor:
        return group_norms(tensors, GROUPS, parameter_group, self.device, self.parallel_dims.get_optional_mesh("pp"))

    def _weights(self) -> list[tuple[str, torch.nn.Parameter, torch.Tensor]]:
        """Each parameter with a copy of its weights, before the optimizer step."""
        return [(name, p, p.detach().clone()) for name, p in self._named_parameters()]

    def _group_norm_metrics(self, before) -> dict[str, dict[str, float]]:
        """metrics.group_grad_norms: each group's gradient norm (before clipping) and the norm of
        its update (the weights after the optimizer step less those before)."""
        updates = self._group_norms((name, p.detach() - weights) for name, p, weights in before)
        grads, self.group_grad_norms = self.group_grad_norms, None
        return {
            "group_grad_norms": group_norm_values(grads, GROUPS),
            "group_update_norms": group_norm_values(updates.cpu(), GROUPS),
        }

    def _logged_values(
        self, losses: list[torch.Tensor], global_valid_tokens: torch.Tensor, local_valid_tokens: torch.Tensor
    ) -> Callable[[], tuple[float, float, int]]:
        """A logged step's loss (summed over its micro-batches and every rank's tokens), the largest
        of the ranks' own mean losses and the tokens seen, as torchtitan logs them: under dp or cp
        reduced over the ranks on the device and copied to the host here, before the update is
        queued. Returns their reader, for after the guard's wait."""
        mesh = self.parallel_dims.get_optional_mesh("loss") if self.parallel_dims.dp_cp_enabled else None
        if mesh is None:

            def read():  # the losses are host copies already (forward_backward_step)
                loss = torch.stack(losses).sum().item()
                return loss, loss, self.ntokens_seen

            return read
        loss = torch.stack(losses).sum()
        if isinstance(loss, DTensor):  # loss parallel under tp
            loss = loss.full_tensor()
        seen = to_device(torch.tensor(self.ntokens_seen, dtype=torch.int64), self.device)
        copies = [
            self.guard.copies.copy(v)
            for v in (
                funcol.all_reduce(loss, "sum", mesh),
                funcol.all_reduce(loss * global_valid_tokens / local_valid_tokens, "max", mesh),
                funcol.all_reduce(seen, "sum", mesh),
            )
        ]
        return lambda: (copies[0].item(), copies[1].item(), int(copies[2].item()))

    def should_continue_training(self) -> bool:
        """Called before every step; also where a stop request is agreed on by every rank."""
        if self.start_step is None:  # the first call: the checkpoint (if any) is loaded
            self.start_step = self.step
            self.check_loaded_weights()
            if self.metrics_processor.jsonl:
                self.metrics_processor.jsonl.start(self.step)
        if not super().should_continue_training():
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
        if config.comm.mode != "default":
            # torchtitan's dry run (NGPU fake ranks in one process): titan_fold's own (dryrun/)
            if dry_run is None:
                raise UserError(f"comm.mode = {config.comm.mode!r}: start it with python -m titan_fold.train")
            return dry_run(config)
        preflight(config, int(os.environ.get("WORLD_SIZE", "1")))
        fit_warmup(config)
        if "LOCAL_RANK" not in os.environ:
            raise UserError("start the trainer with torchrun: torchrun --nproc_per_node N -m titan_fold.train ...")
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
        report(StorageError(f"{e}; {last_checkpoint_text(config)}"))
        return e.exit_code
    except UserError as e:
        report(e)  # one line, also in torchrun's error file in place of the traceback
        return e.exit_code
    except NonFiniteError as e:
        clean = True  # every rank raised it at the same step
        say(
            f"error: {e}; stopped before the optimizer step, nothing saved from it; {last_checkpoint_text(config)} "
            f"(training.nonfinite = 'skip' skips such steps instead)"
        )
        return e.exit_code
    except StopRequested as e:
        clean = True
        what = "interrupted" if e.exit_code == 130 else f"stopped by {stop_signals.name or 'a signal'}"
        say(f"{what} at step {e.step}; {last_checkpoint_text(config)}")
        return e.exit_code
    except Exception:
        problem = storage_problem(config.job.dump_folder) if lock is not None else None
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
