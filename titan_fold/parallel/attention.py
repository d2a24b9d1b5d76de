"""The attention side of the layout: tensor + sequence parallelism (tp) and context parallelism (cp).

    apply_tp(model, tp_mesh, loss_parallel)   the DTensor styles of placement.tp_plan
    apply_cp(model, cp_mesh)                  inner attention over K/V gathered across cp
    cp_shard(tokens, labels, cp_mesh)         the load-balanced split the trainer feeds the model
                                              (packed documents: parallel/cp_documents.py)

Both apply_* work on a model built on the meta device (before `to_empty()` + `init_weights()`)
and come before FSDP2. Data flow of one block on a rank, with sequence parallelism:

    x [b, s/(cp*tp), dim] (DTensor Shard(1) over tp)
    attention_norm -> all-gather seq over tp -> wq/wk/wv colwise (local heads) -> RoPE
      -> CP: all-gather K, V over cp -> SDPA on local tensors -> wo rowwise -> reduce-scatter seq
    ffn_norm -> MoE on this rank's tokens [b, s/(cp*tp), dim] as a plain tensor
      (router and shared_expert_gate: replicated weights on local token rows; shared expert:
      all-gather rows -> colwise w1/w3 -> rowwise w2 -> reduce-scatter rows)

The residual stream stays a DTensor between blocks, so the model's own `h.shape[1]` is the
(cp-local) sequence length and its RoPE tables line up without the model knowing about tp.
"""

from types import MethodType

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from titan_fold.common.tensors import local
from titan_fold.compat.distributed import funcol
from titan_fold.models.attention import attend
from titan_fold.models.documents import DocumentMask
from titan_fold.parallel.placement import tp_plan

# ---------------------------------------------------------------- tensor / sequence parallel


def _grads_like_params(model: nn.Module) -> None:
    """Give every DTensor parameter's gradient the parameter's own placements.

    Autograd leaves them wherever the backward ops put them: norms, router gate and
    shared_expert_gate see different tokens on each tp rank, so their gradients come out
    `Partial` (correct values, reduction deferred); the embedding's comes out `Replicate`.
    FSDP2 redistributes them itself before its reduce-scatter (and replaces these parameters,
    so these hooks never run under it); without FSDP the optimizer and the gradient norm
    would each redistribute again on every use, so do it once, as each gradient is complete:
    an all-reduce over tp for Partial -> Replicate, a local slice for Replicate -> Shard.
    """

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None and param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(placements=param.placements)

    def register(module, args=()) -> None:
        # at forward, not now: to_empty() after parallelizing a meta model swaps every
        # parameter's contents and drops hooks registered on it (the marker goes with them)
        for param in module.parameters():
            if isinstance(param, DTensor) and not getattr(param, "_grads_like_params", False):
                param.register_post_accumulate_grad_hook(hook)
                param._grads_like_params = True

    # an instance attribute too: the overlapped pieces (overlap.py) never call the model
    model.grads_like_params = MethodType(register, model)
    model.register_forward_pre_hook(register)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool = True) -> None:
    """Tensor parallelism over tp_mesh: the styles of `placement.tp_plan`, applied as they are.

    sequence_parallel: norms and the MoE run on sequence shards [b, s/tp, dim] between the
    attention / FFN blocks (each rank routes a different tp-th of the tokens). Without it
    every tp rank runs norms and the whole MoE on the full sequence (same tokens, same
    expert gradients on every tp rank): plain replicated norms, router and gates.
    loss_parallel: the output head returns logits sharded on vocab (DTensor `Shard(-1)`),
    to be consumed inside `torch.distributed.tensor.parallel.loss_parallel()`.
    Works on meta-device models; call before FSDP2 (and before activation checkpointing /
    compile, which wrap the blocks the plan names).
    """
    parallelize_module(model, tp_mesh, tp_plan(model, sequence_parallel, loss_parallel))
    if sequence_parallel:
        # pipeline stages hand plain tensors to each other: a stage without the embedding
        # takes this rank's sequence shard [b, s/tp, dim], one without the output head returns
        # it; instance attributes, which the overlapped pieces (overlap.py) apply too
        if not model.embeds_tokens:
            model.stage_input = lambda x: DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
            model.register_forward_pre_hook(lambda module, args: (module.stage_input(args[0]), *args[1:]))
        if model.output is None:
            model.stage_output = local
            model.register_forward_hook(lambda module, args, out: module.stage_output(out))
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # each style made its own DTensor of the shared table (both Shard(0)): tie again
        model.output.weight = model.tok_embeddings.weight
    _grads_like_params(model)


# ---------------------------------------------------------------- context parallel


# autograd all-gather (backward: reduce-scatter); torch 2.13 renamed it, 2.11 has the old name
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def _chunks_of(cp_rank: int, cp: int) -> tuple[int, int]:
    # load balance under the causal mask: an early chunk (little to attend to) with a late one
    return cp_rank, 2 * cp - 1 - cp_rank


def cp_positions(cp_rank: int, cp: int, seq_len: int) -> torch.Tensor:
    """Global positions [seq_len / cp] of the tokens cp rank `cp_rank` holds: chunks
    cp_rank and 2*cp-1-cp_rank of 2*cp (`_chunks_of`)."""
    c = seq_len // (2 * cp)
    first, second = _chunks_of(cp_rank, cp)
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def sequence_positions(cp: int, tp: int, local_len: int) -> torch.Tensor:
    """Global position of every token of one sequence as the cp x tp ranks hold it, rank
    after rank in cp_tp mesh order (cp outer, tp inner): each cp rank's part, cut into tp
    contiguous pieces by sequence parallelism. [cp * tp * local_len] int64."""
    seq_len = cp * tp * local_len
    return torch.cat([cp_positions(r, cp, seq_len) for r in range(cp)])


def cp_shard(
    tokens: torch.Tensor, labels: torch.Tensor, cp_mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's part of the batch: sequence chunks i and 2*cp-1-i of 2*cp.

    tokens, labels [b, s] -> tokens_local, labels_local [b, s/cp] and positions_local [s/cp]
    int64, the global positions of the local tokens (the model's `positions` argument:
    RoPE angles). Under tp as well, every tp rank of a cp group gets the same part and
    sequence parallelism splits it further into contiguous tp pieces.
    """
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    s = tokens.shape[1]
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} must be divisible by 2 * cp = {2 * cp} (load-balanced causal split)")
    positions = cp_positions(rank, cp, s).to(tokens.device)
    return tokens.index_select(1, positions), labels.index_select(1, positions), positions


class ContextParallelAttention(nn.Module):
    """Causal attention of this cp rank's queries over the whole sequence's keys and values.

    q [b, heads, 2c, head_dim], k, v [b, kv_heads, 2c, head_dim]: the two chunks cp_shard gave
    this rank, after RoPE at their global positions. K and V are all-gathered over cp (kv heads
    only, before any GQA repeat) with an autograd collective, whose backward reduce-scatters
    their gradients. Each query chunk g then attends to the key prefix of chunks 0..g with a
    lower-right causal mask: the masked-out future chunks are never computed.

    With a document mask (packed documents, parallel/cp_documents.py) q holds this rank's
    blocks of the sample in their own order: K and V are gathered in the cp ranks' order, which
    the mask's keys follow, and attended to under it. A window (sliding-window layers) and sinks
    go to the same kernels as on one rank (models/attention.py).
    """

    def __init__(self, cp_mesh: DeviceMesh, window: int | None = None):
        super().__init__()
        self.cp_mesh = cp_mesh
        self.window = window
        # read once, outside forward: plain ints for torch.compile
        self.cp, self.cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """[b, kv_heads, s/cp, d] -> [s, b, kv_heads, d]: every cp rank's, rank after rank."""
        # sequence first: the collective gathers dim 0 without an extra concat copy
        return _all_gather(x.permute(2, 0, 1, 3).contiguous(), gather_dim=0, group=self.cp_mesh)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: DocumentMask | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if mask is not None:
            k_all, v_all = (self._gather(x).permute(1, 2, 0, 3) for x in (k, v))  # [b, kv_heads, s, d]
            return attend(q, k_all, v_all, mask, sinks)
        cp, rank = self.cp, self.cp_rank
        b, h, s_local, d = q.shape
        c = s_local // 2
        # to global chunk order: chunk g sits at gathered slot 2j (g = j) or 2j+1 (g = 2cp-1-j)
        order = [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]
        index = torch.tensor(order, device=q.device)

        def gather(x: torch.Tensor) -> torch.Tensor:
            # [cp * 2c, b, kv_heads, head_dim] in rank order (rank j: chunks j, 2cp-1-j)
            x = self._gather(x).unflatten(0, (2 * cp, c)).index_select(0, index).flatten(0, 1)
            return x.permute(1, 2, 0, 3)  # [b, kv_heads, s, head_dim], global order

        k_all, v_all = gather(k), gather(v)
        if h != k_all.shape[1]:
            # GQA: repeat the gathered kv heads for their query groups (SDPA with an explicit
            # mask does not take enable_gqa on every backend)
            k_all = k_all.repeat_interleave(h // k_all.shape[1], dim=1)
            v_all = v_all.repeat_interleave(h // v_all.shape[1], dim=1)
        out = []
        for half, g in enumerate(_chunks_of(rank, cp)):
            keys = (g + 1) * c  # the chunk's queries are the last c positions of these keys
            q_chunk = q[:, :, half * c : (half + 1) * c]
            out.append(attend(q_chunk, k_all[:, :, :keys], v_all[:, :, :keys], None, sinks, self.window))
        return torch.cat(out, dim=2)  # [b, heads, 2c, head_dim]


# why context parallelism refuses linear-attention layers (trainer/preflight.py says it first)
LINEAR_ATTENTION_CP = (
    "linear attention (Gated DeltaNet) does not take context parallelism: a rank's tokens need the "
    "recurrent state of every earlier token, held by the cp ranks before it, and titan_fold does not "
    "pass it between them; set parallelism.context_parallel_degree = 1"
)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Swap every block's inner attention for the context-parallel one (no parameters).

    The trainer must feed `cp_shard`'s tokens and pass its positions to the model (packed
    documents: `cp_documents.cp_shard_documents`). Composes with apply_tp in either order: the
    inner attention sees local tensors of this tp rank's heads.
    """
    model.query_part = (cp_mesh.get_local_rank(), cp_mesh.size())
    for block in model.transformer_blocks():
        if block.layer_type == "linear_attention":
            raise ValueError(LINEAR_ATTENTION_CP)
        block.attention.inner_attention = ContextParallelAttention(cp_mesh, block.attention.inner_attention.window)
