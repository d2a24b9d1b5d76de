"""One training step of FoldTrainer: micro-batches to the device, forward and backward,
gradient clipping, the NaN/Inf guard's verdict, the optimizer and lr-schedule steps, the
logged values.

TrainStep holds the step's methods; FoldTrainer (fold_trainer.py) builds what they use (the
attributes annotated below) and runs them in its loop. Nothing in a step waits for the device
before the update is queued (_train_step).
"""

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed.utils import TrainContext
from torchtitan.protocols.model_converter import ModelConvertersContainer
from torchtitan.tools.logging import logger

from titan_fold.checkpoint.manager import FoldCheckpointManager
from titan_fold.checkpoint.saves import maybe_fault
from titan_fold.common.config import JobConfig
from titan_fold.common.errors import UserError
from titan_fold.common.tensors import model_fqn, to_device
from titan_fold.compat.distributed import funcol
from titan_fold.data.rollouts import ADVANTAGES_KEY, LOGPROBS_KEY, ROUTED_EXPERTS_KEY
from titan_fold.models.args import TransformerArgs
from titan_fold.models.documents import one_document
from titan_fold.models.groups import GROUPS, parameter_group
from titan_fold.models.mtp import FUTURE_TOKENS, future_tokens, mtp_modules, without_mtp
from titan_fold.moe import moe_layers
from titan_fold.moe.replay import (
    ROUTED_EXPERTS,
    record_routing,
    replay_routing,
    routing_problem,
    shard_routed_experts,
)
from titan_fold.moe.wgrad import flush_wgrad
from titan_fold.parallel.attention import cp_shard
from titan_fold.parallel.clip import clip_grad_norm_, divides_by_grad_scale, group_norm_values, group_norms
from titan_fold.parallel.cp_documents import cp_order, cp_shard_documents
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.overlap import OverlapSchedule, overlap_forward_backward
from titan_fold.parallel.pipeline import embedding_copies, pipeline_forward_backward, sync_embedding_copies
from titan_fold.trainer.guard import NonFiniteGuard, SkippedStep
from titan_fold.trainer.metrics import FoldMetricsProcessor
from titan_fold.trainer.phases import StepPhases
from titan_fold.trainer.policy import PolicyLoss, policy_target

# the batch's key for the packed samples' order under cp, dealt on the host (_train_step)
CP_ORDER = "cp_order"
# the batch's keys the model is not called with: the loss's (loss_target), the masking's, and
# the rollouts' routing, which moe.routing_replay reads
# the routing a recorded-replay step replays, recorded on this rank's part of the micro-batch by
# an earlier no-grad pass (the Python API's logprobs): [b, s', n_moe_layers, k]
RECORDED_EXPERTS = "recorded_experts"
NOT_MODEL_INPUTS = (
    "input",
    "document_ids",
    CP_ORDER,
    LOGPROBS_KEY,
    ADVANTAGES_KEY,
    ROUTED_EXPERTS_KEY,
    RECORDED_EXPERTS,
)


class TrainStep:
    """The step's methods, over what FoldTrainer built."""

    job_config: JobConfig
    parallel_dims: Layout
    device: torch.device
    model_args: TransformerArgs
    model_parts: list[torch.nn.Module]
    model_converters: ModelConvertersContainer
    loss_fn: Callable[..., torch.Tensor]
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    checkpointer: FoldCheckpointManager
    metrics_processor: FoldMetricsProcessor
    guard: NonFiniteGuard
    train_context: TrainContext
    maybe_enable_amp: AbstractContextManager
    gradient_accumulation_steps: int
    overlap: OverlapSchedule | None
    expert_bias_update: Callable[[], None] | None  # moe.load_balance = "aux_free" (_update)
    phases: StepPhases | None
    _forward_phase: str  # the phase a micro-batch's forward starts (phases.py), set with phases
    group_grad_norms: torch.Tensor | None  # metrics.group_grad_norms: from the clip to the log
    cudagraphs: bool
    step: int
    ntokens_seen: int
    step_metrics: dict[str, Any]  # a logged step's record, as logged (_train_step)

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        # torchtitan's version would apply torch's context_parallel; ours shards the batch
        inputs = input_dict["input"]
        extra_inputs = {k: v for k, v in input_dict.items() if k not in NOT_MODEL_INPUTS}
        extra_kwargs = {}
        routed = self._routed_experts(input_dict)
        if "document_ids" in input_dict:  # every pipeline stage masks attention by document
            extra_kwargs["document_ids"] = input_dict["document_ids"]
        layout = self.parallel_dims
        mtp_layers = self.model_args.mtp_layers
        # taken before the loss target: the MTP layers' targets are the labels (the policy's too)
        future = future_tokens(inputs, labels, mtp_layers) if mtp_layers else None
        labels = self.loss_target(input_dict, labels)
        cp_index = None  # the cp rank's token indices, for routed_experts
        if CP_ORDER in input_dict:  # packed documents: blocks dealt by their work (cp_documents.py)
            inputs, labels, extra_kwargs["document_ids"], extra_kwargs["positions"] = cp_shard_documents(
                inputs, labels, input_dict["document_ids"], input_dict[CP_ORDER], layout.attention["cp"]
            )
            n, cp_rank = inputs.shape[1], layout.attention["cp"].get_local_rank()
            cp_index = input_dict[CP_ORDER][:, cp_rank * n : (cp_rank + 1) * n]
        elif layout.cp > 1:
            # load-balanced causal split; the model needs the global positions for RoPE
            inputs, labels, extra_kwargs["positions"] = cp_shard(inputs, labels, layout.attention["cp"])
            cp_index = extra_kwargs["positions"]
            if future is not None:  # taken before the split: tokens ahead may sit in another rank's chunk
                future = future.index_select(1, extra_kwargs["positions"])
        if future is not None:
            extra_kwargs[FUTURE_TOKENS] = future
        if routed is not None:  # a kwarg: every pipeline stage's MoE layers read their own columns
            tp_rank = layout.attention["tp"].get_local_rank() if layout.tp > 1 else 0
            extra_kwargs[ROUTED_EXPERTS] = shard_routed_experts(routed, cp_index, layout.tp, tp_rank)
        return inputs, labels, extra_inputs, extra_kwargs

    def loss_target(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """What the loss receives beside the logits, [b, s, ...]: the labels, and under the policy
        objective each label's behaviour log-probability and advantage with them (policy.py), so
        that cp shards them and the pipeline schedule splits them as it does the labels."""
        if not isinstance(self.loss_fn, PolicyLoss):
            return labels
        return policy_target(labels, input_dict[LOGPROBS_KEY], input_dict[ADVANTAGES_KEY])

    def _routed_experts(self, input_dict: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The batch's routed_experts under moe.routing_replay = "rollout", checked against the batch
        and the model; None in the other modes (a batch's ids are then not used)."""
        if self.model_args.moe.routing_replay != "rollout":
            return None
        if ROUTED_EXPERTS not in input_dict:
            raise UserError(
                "moe.routing_replay = 'rollout': this batch has no routed_experts (its rollout records "
                "carry none); add them to the records or set moe.routing_replay = 'recorded' or 'off'"
            )
        routed = input_dict[ROUTED_EXPERTS]
        problem = routing_problem(
            routed, input_dict["input"], self.model_args.n_moe_layers(), self.model_args.moe.top_k
        )
        if problem:
            raise UserError(f"moe.routing_replay = 'rollout': {problem}")
        return routed

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
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

    def _forward_backward(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
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
            loss = self._one_part_forward_backward(input_dict, labels, global_valid_tokens)
        flush_wgrad(self.model_parts)  # weight gradients still queued (moe.ep_overlap "wgrad" or "batch_wgrad")
        maybe_fault(self.step)  # tests: a rank killed in the middle of a step
        return loss

    def _one_part_forward_backward(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The one model part's forward and backward: the loss summed over this micro-batch's
        tokens and divided by the step's (global_valid_tokens) -> that loss."""
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(input_dict, labels)
        if self.model_args.moe.routing_replay == "recorded":
            # R2: a no-grad forward of the current weights records the routing the training
            # forward (and its recompute) replays
            if RECORDED_EXPERTS in input_dict:  # recorded by the Python API's logprobs pass (api.py)
                extra_kwargs[ROUTED_EXPERTS] = input_dict[RECORDED_EXPERTS]
            else:
                with record_routing(self.model_parts, inputs) as recording, self.train_context():
                    with self.maybe_enable_amp:
                        self.model_parts[0](inputs, **extra_inputs, **without_mtp(extra_kwargs))
                assert recording.recorded is not None  # set as the block exits
                extra_kwargs[ROUTED_EXPERTS] = replay_routing(recording.recorded, inputs)
        with self.train_context():  # loss parallel under tp: the backward too
            with self.maybe_enable_amp:
                pred = self.model_parts[0](inputs, **extra_inputs, **extra_kwargs)
                loss = self.loss_fn(pred, labels) / global_valid_tokens
            del pred  # the logits, the largest activation, freed before backward
            loss.backward()
        return loss

    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter], *args: Any, **kwargs: Any) -> torch.Tensor:
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

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
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

    def _train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """torchtitan's Trainer.train_step with nothing in it that waits for the device before the
        update is queued. torchtitan moves the batches and their token count with blocking copies
        and sums the count over the batch ranks on the host, and under dp or cp reads the logged
        loss's reductions over the ranks on the host after the update is queued: each waits for
        the work queued before it (the step before's or this step's update), and the device then
        idles while the host queues the next kernels. Here the count is summed on the device,
        every copy to the device is queued behind the work there (common/tensors.py: to_device),
        and the logged values reach the host by copies queued before the update (_logged_values)."""
        self.optimizers.zero_grad()
        if isinstance(self.loss_fn, PolicyLoss):
            self.loss_fn.stats.reset()  # the logged statistics are this step's
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        layout = self.parallel_dims
        # the micro-batches stay on the host until their turn; their tokens are counted there
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        for input_dict, _ in microbatches:  # read on the host: no wait for the device
            if "document_ids" not in input_dict:
                continue
            if layout.cp > 1:
                input_dict[CP_ORDER] = cp_order(input_dict["document_ids"], layout.cp)
            elif one_document(input_dict["document_ids"]):
                # the causal mask, where the stream's kernel is the faster (under cp the
                # stream's split attention is the slower one: docs/benchmarks.md)
                del input_dict["document_ids"]
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
        logs = self._logs()
        read = self._logged_values(losses, global_valid_tokens, local_valid_tokens) if logs else None
        self.checkpointer.maybe_wait_for_staging()
        before = self._weights() if logs and self.group_grad_norms is not None else None
        self._update(logs)
        if read is not None:  # logged: the guard's wait, once the update was queued, has brought the values
            avg_loss, max_loss, ntokens_seen = read()
            extra = {"n_tokens_seen": ntokens_seen, "lr": lr}
            if before is not None:
                extra.update(self._group_norm_metrics(before))
            self.step_metrics = self.metrics_processor.log(
                self.step, avg_loss, max_loss, grad_norm.item(), extra_metrics=extra
            )

    def _update(self, logs: bool) -> None:
        """The optimizers' step and what surrounds it, in this order: the NaN/Inf guard's verdict
        (guard.py: handed to fused optimizers as found_inf, else read and acted on here), a logged
        step's MoE statistics staged beside it, the step, the model converters' work after it
        (float8's amax and scale of every parameter, in one all-reduce), the verdict read and
        acted on (a stop or skip raises before the router bias and the lr schedule move), the
        aux-free router bias, the lr schedule."""
        # one profiler range: bench/trace_summary.py counts the kernels in it as the optimizer's
        with torch.profiler.record_function(f"Optimizer.step#{type(self).__name__}._update"):
            self.guard.before_optimizer_step()
            if logs:  # queued before the optimizer's kernels; the guard's wait brings them (host_copies.py)
                self.metrics_processor.stage(self.guard.copies.copy)
            if self.phases is not None:
                self.phases.mark("optimizer")
            self.optimizers.step()
            self.model_converters.post_optimizer_hook(self.model_parts)
            self.guard.after_optimizer_step()
            if self.expert_bias_update is not None:
                self.expert_bias_update()
            if self.phases is not None:
                self.phases.mark("rest")
        self.lr_schedulers.step()

    def _named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters by their names in the model (without the wrappers of compile and
        activation checkpointing), less the MTP layers' embedding copy under pp (counted on the
        first stage, as in the gradient norm)."""
        skip = {id(p) for p in embedding_copies(self.model_parts)}
        return [
            (model_fqn(name), p)
            for part in self.model_parts
            for name, p in part.named_parameters()
            if id(p) not in skip
        ]

    def _group_norms(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> torch.Tensor:
        return group_norms(tensors, GROUPS, parameter_group, self.device, self.parallel_dims.get_optional_mesh("pp"))

    def _weights(self) -> list[tuple[str, torch.nn.Parameter, torch.Tensor]]:
        """Each parameter with a copy of its weights, before the optimizer step."""
        return [(name, p, p.detach().clone()) for name, p in self._named_parameters()]

    def _group_norm_metrics(
        self, before: list[tuple[str, torch.nn.Parameter, torch.Tensor]]
    ) -> dict[str, dict[str, float]]:
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

            def read() -> tuple[float, float, int]:  # the losses are host copies already (forward_backward_step)
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
