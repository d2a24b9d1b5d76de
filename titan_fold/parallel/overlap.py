"""Batch-level overlap of the expert all-to-alls (`moe.ep_overlap = "batch"`, Megatron-Core's
--overlap-moe-expert-parallel-comm): the forward of one micro-batch and the backward of the
previous one, interleaved layer by layer, so that each one's all-to-alls run under the
other's compute.

A micro-batch's forward is cut into pieces at its all-to-alls. An MoE block is

    attention  x -> h = x + attention(norm(x)); router; shared expert; permute -> rows to send
    dispatch   all-to-all over ep of the rows and their routing weights          (comm)
    experts    all-gather over etp, grouped GEMMs, reduce-scatter over etp        (compute)
    combine    all-to-all over ep back                                            (comm)
    post       out = h + unpermute(rows) + shared expert

a dense block, the embedding and the head (norm, output, loss) are one piece each. A
compute piece runs on inputs cut from the graph before it (detached, requiring grad), so its
backward runs on its own: `torch.autograd.backward(outputs, grads)` gives its inputs'
gradients to the piece before it. A comm piece issues a functional all-to-all (async: on a
GPU on the process group's stream) and is waited for where the next piece reads its result;
its backward is the reverse all-to-all, issued the same way.

Forward and backward are generators that stop right after each all-to-all is issued. With
two micro-batches A (backward) and B (forward), alternating them gives, for each pair of
MoE layers (B's layer l, A's layer m, m counting down):

    A: post backward,  issue combine backward a2a
    B: attention forward, issue dispatch a2a          | under A's combine backward a2a
    A: experts backward (dX), issue dispatch backward | under B's dispatch a2a
    B: experts forward, issue combine a2a             | under A's dispatch backward a2a
    A: experts weight gradients (W), attention backward | under B's combine a2a
    B: post forward ...

With moe.ep_overlap = "batch_wgrad" the experts' weight gradients are split from their input
gradients (moe/wgrad.py), so that the dispatch backward a2a waits only for dX and W fills
the next slot; without it W runs with dX. With FSDP2 over the experts (edp > 1) W runs
before the unit's reduce-scatter instead (moe/wgrad.py).

Gradient accumulation over n >= 2 micro-batches runs: forward 0; then (backward i-1 |
forward i) for i = 1 .. n-1; then backward n-1. Every rank runs the same pieces in the same
order, so the collectives match; on the CPU (gloo) the same code runs in the same order.

Under pipeline parallelism (Schedule1F1B, ScheduleInterleaved1F1B) the pairs are the
steady state's: on each pp rank, a backward the schedule runs directly before a forward
(another micro-batch's, or another stage's) becomes one OVERLAP_F_B action of torch's
`_PipelineScheduleRuntime`, whose lowering places both halves' P2P sends and recvs; the
runtime's FORWARD, FULL_BACKWARD and OVERLAP_F_B actions all run as pieces (StagePieces).
A stage's pieces start from its received hidden states, or the tokens on the first stage;
a stage without the head ends with its hidden states, whose received gradient starts its
backward. The ranks of an ep group share a pp rank, hence its action list: their
all-to-alls match as without PP.
FSDP2 units are entered through their registered forward methods (an attention piece is a
call of its block, the embedding and head of the root), so their gathers and reduce-scatters
happen as in a plain forward and backward.
"""

import contextlib
from collections.abc import Iterator
from types import MethodType

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor

from titan_fold.common.moe_config import batch_overlap
from titan_fold.common.tensors import local, waited
from titan_fold.compat.distributed import funcol
from titan_fold.compat.pipelining import (
    Action,
    PipelineScheduleRuntime,
    assert_unsharded,
    prepare_with_comms,
    received_activations,
    received_grads,
    record_loss,
    schedule_loss_fn,
    schedule_stages,
    wait_batch_p2p,
)
from titan_fold.moe import moe_layers
from titan_fold.moe.router import AddAuxLoss
from titan_fold.moe.wgrad import WgradQueue


class Piece:
    """A compute piece: fn(*inputs) -> tuple of outputs (tensors, or anything else, which
    backward skips), on inputs cut from the graph before it."""

    def __init__(self, name: str, fn, *sources):
        self.name = name
        self.sources = sources  # the tensors it reads, as their producers gave them
        self.inputs = [_cut(t) for t in sources]
        self.outputs = fn(*self.inputs)

    def backward(self, grads: list) -> list:
        pairs = [
            (o, waited(g))
            for o, g in zip(self.outputs, grads, strict=True)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [t.grad if isinstance(t, torch.Tensor) else None for t in self.inputs]


def _cut(t):
    # an all-to-all's result is waited for here, where it is first read
    if not isinstance(t, torch.Tensor):
        return t
    return waited(t).detach().requires_grad_(t.requires_grad)


class AllToAll:
    """A comm piece: tensors [rows, ...] to the ep ranks, `send` rows to each, `recv` from each."""

    def __init__(self, name: str, sources, send, recv, mesh):
        self.name, self.sources, self.send, self.recv, self.mesh = name, sources, send, recv, mesh
        self.outputs = [_a2a(t.detach(), recv, send, mesh).requires_grad_(t.requires_grad) for t in sources]

    def backward(self, grads: list) -> list:
        return [None if g is None else _a2a(waited(g), self.send, self.recv, self.mesh) for g in grads]


def _a2a(t, out_splits, in_splits, mesh):
    return funcol.all_to_all_single(t.contiguous(), out_splits, in_splits, mesh)


class MicroBatch:
    """One micro-batch's pieces on a model or a pipeline stage's model; forward() and
    backward() are generators that stop after each all-to-all is issued.

    inputs: token ids, or a later pipeline stage's hidden states [b, s, dim];
    loss_fn(logits, labels) -> the loss, or None on a pipeline stage without the loss.
    After forward, `output` is what backward starts from: the loss, or the stage's output."""

    def __init__(self, model: nn.Module, inputs, labels, loss_fn, positions=None, index: int = 0):
        self.model, self.inputs, self.labels, self.index = model, inputs, labels, index
        self.loss_fn, self.positions = loss_fn, positions
        self.pieces: list = []  # forward order
        self.wgrad: dict[int, WgradQueue] = {}  # experts piece index -> its layer's weight-gradient queue
        self.output: torch.Tensor | None = None
        self.input_grad = None  # after backward: the gradient of hidden-state inputs

    def forward(self) -> Iterator[None]:
        model = self.model
        (h,) = self._compute("embed", model.overlap_embed, self.inputs)
        cos, sin = model.rope(h.shape[1], self.positions)
        for i, block in model.layers.items():
            if not block.moe_enabled:
                (h,) = self._compute(f"layer{i} dense", lambda x, block=block: (block(x, cos, sin),), h)
                continue
            moe = block.moe
            h, shared, x_rows, w_rows, plan = self._compute(
                f"layer{i} attention", lambda x, block=block: block.overlap_attention(x, cos, sin), h
            )
            sp, mesh = plan.splits, moe.dispatcher.ep_mesh  # ep > 1 (overlap_problem)
            x_in, w_in = self._comm(f"layer{i} dispatch a2a", [x_rows, w_rows], sp.send, sp.recv, mesh)
            yield
            (y_in,) = self._compute(
                f"layer{i} experts",
                lambda x, w, moe=moe, plan=plan: (moe.dispatcher.compute(x, w, plan, moe.experts, moe.args),),
                x_in,
                w_in,
            )
            if moe.experts.wgrad is not None:
                self.wgrad[len(self.pieces) - 1] = moe.experts.wgrad
            (y_rows,) = self._comm(f"layer{i} combine a2a", [y_in], sp.recv, sp.send, mesh)
            yield
            (h,) = self._compute(
                f"layer{i} post", lambda r, y, s, moe=moe, plan=plan: (_post(moe, plan, r, y, s),), h, y_rows, shared
            )
        (self.output,) = self._compute("head", lambda x: (self._loss(model.overlap_head(x)),), h)

    def _loss(self, out):
        return out if self.loss_fn is None else self.loss_fn(out, self.labels)

    def backward(self, output_grad: torch.Tensor | None = None) -> Iterator[None]:
        """output_grad: the gradient of a stage's output; None: the output is the loss."""
        # output -> its gradient, summed over readers
        grads = {id(self.output): torch.ones_like(self.output) if output_grad is None else output_grad}
        pending_wgrad = None  # (name, queue)
        for i in range(len(self.pieces) - 1, -1, -1):
            piece = self.pieces[i]
            if pending_wgrad is not None and isinstance(piece, Piece):
                with self._label(f"backward {pending_wgrad[0]} W"):
                    pending_wgrad[1].flush()  # the experts' W, beside the other micro-batch's combine a2a
                pending_wgrad = None
            with self._label(f"backward {piece.name}"):
                in_grads = piece.backward([grads.pop(id(o), None) for o in piece.outputs])
            for source, g in zip(piece.sources, in_grads, strict=True):
                if g is not None:
                    grads[id(source)] = g if id(source) not in grads else waited(grads[id(source)]) + waited(g)
            self.pieces[i] = piece.name  # its activations and gradients go now, not at the end
            if i in self.wgrad:
                pending_wgrad = (piece.name, self.wgrad[i])
            if isinstance(piece, AllToAll):
                yield
        self.input_grad = grads.get(id(self.inputs))
        self.pieces.clear()

    def _label(self, what: str):
        # the pieces' order in a profiler trace (bench/overlap_trace.py)
        return torch.profiler.record_function(f"overlap:mb{self.index} {what}")

    def _compute(self, name: str, fn, *inputs):
        with self._label(f"forward {name}"):
            piece = Piece(name, fn, *inputs)
        self.pieces.append(piece)
        return piece.outputs

    def _comm(self, name: str, tensors, send, recv, mesh):
        with self._label(f"forward {name}"):
            piece = AllToAll(name, tensors, send, recv, mesh)
        self.pieces.append(piece)
        return piece.outputs


def _attention(block, x: torch.Tensor, cos, sin):
    """An MoE block up to the dispatch, as MoE.forward: x [b, s, dim] -> (h, shared expert
    output or None, rows to send [R, dim], their weights [R], plan)."""
    h = x + block.attention(block.attention_norm(x), cos, sin)  # [b, s, dim]
    moe = block.moe
    tokens = local(block.ffn_norm(h))  # this rank's tokens, as the MoE takes them under sequence parallel
    b, s, dim = tokens.shape
    tokens = tokens.reshape(b * s, dim)  # [T, dim]
    routing = moe.router(tokens, s, moe.aux_loss_scale, moe.seq_mesh)
    shared = moe._shared(tokens) if moe.shared_expert is not None else None
    if moe.args.load_balance in ("aux_loss", "seq_aux_loss") or moe.args.z_loss_coeff > 0:
        h = AddAuxLoss.apply(h, routing.loss)  # identity; the aux losses enter backward with h's gradient
    plan, x_rows, w_rows = moe.dispatcher.permute(tokens, routing.probs, routing.experts, moe.args, b)
    moe._record(routing, plan.keep)
    return h, shared, x_rows, w_rows, plan


def _post(moe, plan, h: torch.Tensor, y_rows: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    y = moe.dispatcher.unpermute(y_rows, plan)  # [T, dim]
    if shared is not None:
        y = y + shared
    y = y.view(local(h).shape)
    if isinstance(h, DTensor):  # sequence parallel: the MoE returns this rank's tokens as h is placed
        y = DTensor.from_local(y, h.device_mesh, h.placements, run_check=False)
    return h + y


def _embed(model, x):
    # as the model's forward pre-hooks (attention.apply_tp): gradients placed like their
    # parameters; then as Transformer.forward: a later pipeline stage takes the hidden states,
    # placed as the hook places them under sequence parallel
    grads_like_params = getattr(model, "grads_like_params", None)
    if grads_like_params is not None:
        grads_like_params()
    if model.embeds_tokens:
        return (model.tok_embeddings(x),)
    stage_input = getattr(model, "stage_input", None)
    return (x if stage_input is None else stage_input(x),)


def _head(model, h):
    # as Transformer.forward: a pipeline stage without them passes h on (a plain tensor)
    out = model.norm(h) if model.norm is not None else h
    if model.output is not None:
        return model.output(out)
    stage_output = getattr(model, "stage_output", None)
    return out if stage_output is None else stage_output(out)


def prepare(model: nn.Module) -> None:
    """Give the model's blocks and root the forward methods the pieces call: FSDP2 gathers a
    unit's parameters around each and reduces their gradients after its backward."""
    model.overlap_embed = MethodType(_embed, model)
    model.overlap_head = MethodType(_head, model)
    register_fsdp_forward_method(model, "overlap_embed")
    register_fsdp_forward_method(model, "overlap_head")
    for block in model.layers.values():
        if block.moe_enabled:
            block.overlap_attention = MethodType(_attention, block)
            register_fsdp_forward_method(block, "overlap_attention")


def interleave(backward: Iterator[None], forward: Iterator[None], context, forward_context) -> None:
    """One step of backward, then one of forward, until both are done; every step under
    context(), forward steps under forward_context() too (autocast)."""
    running = [(backward, context), (forward, lambda: _both(context, forward_context))]
    while running:
        for item in list(running):
            gen, ctx = item
            with ctx():
                if next(gen, StopIteration) is StopIteration:
                    running.remove(item)


@contextlib.contextmanager
def _both(first, second):
    with first(), second():
        yield


class OverlapSchedule:
    """Gradient accumulation with the micro-batches overlapped in pairs. step() is called once
    per micro-batch, as the trainer's forward_backward_step, and returns its loss; the n-th
    call of a training step finishes every backward.

    context(): what the trainer runs forward and backward under (loss parallel);
    forward_context(): what it runs only forward under (autocast)."""

    def __init__(
        self,
        model: nn.Module,
        micro_batches: int,
        context=contextlib.nullcontext,
        forward_context=contextlib.nullcontext,
    ):
        prepare(model)
        self.model, self.micro_batches = model, micro_batches
        self.context, self.forward_context = context, forward_context
        self.pending: MicroBatch | None = None
        self.done = 0

    def step(self, inputs, labels, loss_fn, positions=None) -> torch.Tensor:
        mb = MicroBatch(self.model, inputs, labels, loss_fn, positions, self.done)
        previous = self.pending.backward() if self.pending is not None else iter(())
        interleave(previous, mb.forward(), self.context, self.forward_context)
        self.done += 1
        if self.done == self.micro_batches:
            interleave(mb.backward(), iter(()), self.context, self.forward_context)
            self.pending, self.done = None, 0
        else:
            self.pending = mb
        assert mb.output is not None  # set by its forward
        return mb.output.detach()


def one_f_one_b(rank: int, pp: int, n: int) -> list[Action]:
    """Schedule1F1B's compute actions on one pp rank (stage = rank): pp - rank forwards,
    then a backward and a forward in turn, then the last backwards."""
    warmup = min(n, pp - rank)
    actions = [Action(rank, FORWARD, i) for i in range(warmup)]
    for j in range(n):
        actions.append(Action(rank, FULL_BACKWARD, j))
        if warmup + j < n:
            actions.append(Action(rank, FORWARD, warmup + j))
    return actions


def pair_steady_state(actions: list) -> list:
    """Each backward directly followed by a forward on one rank -> one OVERLAP_F_B of the two.
    A backward comes after its own micro-batch's forward, so the forward it pairs with is
    another micro-batch's (or another stage's)."""
    out: list = []
    for a in actions:
        b = out[-1] if out else None
        if a is not None and a.computation_type == FORWARD and b is not None and b.computation_type == FULL_BACKWARD:
            out[-1] = Action(-1, OVERLAP_F_B, None, (a, b))
        else:
            out.append(a)
    return out


def overlapped_pipeline(cls: type, stages: list, n_microbatches: int, loss_fn, pre_forward: list):
    """The pipeline schedule `cls` (Schedule1F1B or ScheduleInterleaved1F1B) with its steady
    state's pairs overlapped: a `_PipelineScheduleRuntime` of the same compute order, each
    (backward, forward) pair one OVERLAP_F_B, the P2P sends and recvs placed by torch's
    lowering. pre_forward[k](module, args, kwargs) -> (args, kwargs): stages[k]'s forward
    pre-hook (pipeline.StageHooks), which the pieces run in place of the module's call."""
    if cls is ScheduleInterleaved1F1B:
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        order = schedule.pipeline_order
    else:
        schedule = PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        pp = stages[0].group_size
        order = {r: one_f_one_b(r, pp, n_microbatches) for r in range(pp)}
    schedule.pipeline_order = {r: pair_steady_state(actions) for r, actions in order.items()}
    prepare_with_comms(schedule, schedule.pipeline_order)
    run = StagePieces(schedule, dict(zip((s.stage_index for s in stages), pre_forward, strict=True)))
    for kind in (FORWARD, FULL_BACKWARD, OVERLAP_F_B):
        schedule.register_custom_function(kind, run)
    return schedule


class StagePieces:
    """The runtime schedule's FORWARD, FULL_BACKWARD and OVERLAP_F_B actions, run as
    MicroBatch pieces of the stage's model: an OVERLAP_F_B interleaves its backward with its
    forward as `interleave` does without PP. Each action leaves the stage what torch's own
    forward_one_chunk / backward_one_chunk would: the output to send (fwd_cache), the loss
    (the schedule's losses), the input gradient to send (bwd_cache)."""

    def __init__(self, schedule, pre_forward: dict):
        self.schedule, self.pre_forward = schedule, pre_forward
        self.stages = {stage.stage_index: stage for stage in schedule_stages(schedule)}
        self.micro_batches: dict[tuple[int, int], MicroBatch] = {}  # (stage, micro-batch) -> forward done
        for stage in self.stages.values():
            prepare(stage.submod)

    def __call__(self, action, ctx) -> None:
        forward: Iterator[None] = iter(())
        backward: Iterator[None] = iter(())
        for a in action.sub_actions or (action,):
            if a.computation_type == FORWARD:
                forward = self.forward(a.stage_index, a.microbatch_index, ctx)
            else:
                backward = self.backward(a.stage_index, a.microbatch_index)
        interleave(backward, forward, contextlib.nullcontext, contextlib.nullcontext)

    def forward(self, s: int, i: int, ctx) -> Iterator[None]:
        stage, schedule = self.stages[s], self.schedule
        assert_unsharded(schedule, stage)
        if stage.is_first:
            args = ctx.arg_mbs[i]
        else:  # loop placement: the previous stage is on another pp rank
            wait_batch_p2p(schedule.fwd_recv_ops.pop((s, i)))
            args = received_activations(stage, i)
        args, kwargs = self.pre_forward[s](stage.submod, args, dict(ctx.kwarg_mbs[i]))
        last = stage.is_last
        mb = MicroBatch(
            stage.submod,
            args[0],
            ctx.target_mbs[i] if last else None,
            schedule_loss_fn(schedule) if last else None,
            kwargs.get("positions"),
            i,
        )
        yield from mb.forward()
        self.micro_batches[s, i] = mb
        stage.fwd_cache[i] = ((mb.output,), list(args))
        if last:
            record_loss(schedule, mb.output)

    def backward(self, s: int, j: int) -> Iterator[None]:
        stage, schedule = self.stages[s], self.schedule
        assert_unsharded(schedule, stage)
        grad = None
        if not stage.is_last:
            wait_batch_p2p(schedule.bwd_recv_ops.pop((s, j)))
            (grad,) = received_grads(stage, j)
        if isinstance(stage.submod, FSDPModule):
            # as the stage's own backward: the schedule's REDUCE_GRAD reduces after the last one
            stage.submod.set_is_last_backward(False)
            stage.submod.set_reshard_after_backward(False)
            stage.submod.set_requires_gradient_sync(False)
        mb = self.micro_batches.pop((s, j))
        yield from mb.backward(grad)
        stage.fwd_cache.pop(j)
        if not stage.is_first:
            stage.bwd_cache[j] = (mb.input_grad,)


def micro_batches(config, layout) -> int:
    """Gradient-accumulation micro-batches per step without PP."""
    tr = config.training
    per_step = tr.local_batch_size * layout.dp
    return (tr.global_batch_size if tr.global_batch_size > 0 else per_step) // per_step


def overlap_problem(config, layout) -> str | None:
    """Why moe.ep_overlap's batch overlap cannot apply with this layout's data parallelism, or None (the
    rules that need no layout are common/rules.py's)."""
    if batch_overlap(config.moe.ep_overlap) and layout.pp == 1 and (n := micro_batches(config, layout)) < 2:
        tr = config.training
        return (
            f"moe.ep_overlap = '{config.moe.ep_overlap}' needs at least 2 micro-batches per step; training.global_batch_size "
            f"{tr.global_batch_size} / (training.local_batch_size {tr.local_batch_size} x dp {layout.dp}) = {n}"
        )
    return None


def overlap_forward_backward(trainer, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
    """FoldTrainer.forward_backward_step with moe.ep_overlap's batch overlap: this micro-batch's forward
    beside the previous one's backward; -> its loss sum / global tokens."""
    from torchtitan.components.loss import IGNORE_INDEX

    scale = (labels != IGNORE_INDEX).sum() / global_valid_tokens
    model = trainer.model_parts[0]
    for moe in moe_layers(model):
        # a new tensor, not fill_: the previous micro-batch's backward still reads its own
        moe.aux_loss_scale = scale.detach().clone()
    inputs, labels, _, extra_kwargs = trainer.post_dataloading_process(input_dict, labels)
    return trainer.overlap.step(
        inputs,
        labels,
        lambda pred, target: trainer.loss_fn(pred, target) / global_valid_tokens,
        extra_kwargs.get("positions"),
    )
