"""Top-k router: scores, expert choice, load-balancing and z losses.

The router only decides; moving tokens is the dispatcher's job. Scores are computed in
float32 at least (float64 stays float64, so the tests can compare against a float64
reference without a float32 bottleneck).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan_fold.compat.distributed import funcol
from titan_fold.compat.ops import maybe_mark_dynamic
from titan_fold.moe.args import MoEArgs
from titan_fold.moe.router_triton import fused_route_whole
from titan_fold.moe.router_triton import supported as fused_supported


@dataclass
class Routing:
    probs: torch.Tensor  # [T, k] combine weights of the chosen experts (float32+)
    experts: torch.Tensor  # [T, k] int64 chosen expert ids
    loss: torch.Tensor  # scalar: coeff-weighted aux + z loss terms of this rank's tokens; enters backward
    balance_loss: torch.Tensor  # scalar, detached: E * sum_e f_e * P_e over the sequence group's tokens (metric)
    tokens_per_expert: torch.Tensor  # [E] float32, detached: routed assignments before any drop
    # [4] float32, detached: this call's addition to MoE.stats (balance loss, dropped share 0 (a
    # token-drop dispatcher adds its own), load imbalance max / mean of tokens_per_expert, 1 call)
    record: torch.Tensor
    # [2] float32, detached, under routing replay: (routings whose replayed experts are not the
    # router's own top-k set, routings); None without replay
    changed: torch.Tensor | None = None


def _group_sum(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    # statistics only (no gradient): counts and detached score sums
    return t if mesh is None else funcol.all_reduce(t, "sum", mesh)


def route(
    logits: torch.Tensor,
    expert_bias: torch.Tensor,
    num_seqs: int,
    args: MoEArgs,
    replayed: torch.Tensor | None = None,
):
    """The router's per-token work as one function (compiled on a GPU, the scores and the choice
    one generated kernel, with groups a few; the statistics' reductions over sequences and
    experts several small ones: bench/routing.py counts them): logits [T, E] (float32 or wider)
    -> (probs [T, k], experts [T, k], score_sums [b, E], counts [b, E], z [] or None, changed [2]
    or None), b = num_seqs sequences of T / b tokens each.

    replayed [T, k] int64 (routing replay, moe/replay.py): the experts are these instead of the
    router's choice, and everything after the choice (combine weights, counts) reads them;
    changed = (tokens whose replayed set is not the router's own top-k set, tokens).

    scores: softmax or sigmoid; the choice adds the aux-free bias (never the combine weights)
    and, with args.num_groups > 1, keeps the experts of the args.group_topk best groups only;
    probs optionally renormalized over the k chosen, then times args.routed_scaling_factor. score_sums: per sequence, the sum of each
    expert's scores normalized to 1 per token (the balance losses' P); counts: assignments per
    expert and sequence (their f), in the scores' dtype; z: sum of logsumexp^2 (z-loss) when
    args.z_loss_coeff > 0."""
    E, k = args.num_experts, args.top_k
    scores = logits.softmax(dim=-1) if args.score_func == "softmax" else logits.sigmoid()
    choice = scores + expert_bias.to(scores.dtype) if args.load_balance == "aux_free" else scores
    if args.num_groups > 1:
        choice = limit_to_groups(choice, args.num_groups, args.group_topk)
    experts = top_k_indices(choice, k)  # [T, k]
    changed = None
    if replayed is not None:
        # -1: a token without a replayed routing (a batch's padding) keeps the router's own
        given = replayed[:, :1] >= 0  # [T, 1]
        differs = (experts.sort(-1).values != replayed.sort(-1).values).any(-1) & given[:, 0]  # [T]
        changed = torch.stack([differs.sum(), given.sum()]).float()
        experts = torch.where(given, replayed, experts)
    probs = scores.gather(-1, experts)  # [T, k]
    if args.norm_topk_prob:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if args.routed_scaling_factor != 1.0:
        probs = probs * args.routed_scaling_factor
    # balance losses see scores that sum to 1 per token (sigmoid scores do not)
    dist = scores if args.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    score_sums = dist.view(num_seqs, -1, E).sum(1)  # [b, E]
    per_seq = experts.view(num_seqs, -1)  # [b, T/b * k]
    counts = torch.zeros(num_seqs, E, dtype=scores.dtype, device=scores.device)
    counts = counts.scatter_add(1, per_seq, torch.ones_like(per_seq, dtype=scores.dtype))  # [b, E]
    z = torch.logsumexp(logits, dim=-1).square().sum() if args.z_loss_coeff > 0 else None
    return probs, experts, score_sums, counts, z, changed


def top_k_indices(choice: torch.Tensor, k: int) -> torch.Tensor:
    """choice [..., E] -> [..., k] int64: the columns of each row's k largest entries, largest first,
    the lower column first among equal ones. k argmax passes, each masking its pick: where the
    expert width is static, torch.compile generates them as one kernel that holds each row in
    registers, where aten's topk runs a radix select per row and then sorts the k it kept
    (bench/routing.py)."""
    columns = torch.arange(choice.shape[-1], device=choice.device)
    picks = []
    for _ in range(k):
        pick = choice.argmax(dim=-1, keepdim=True)  # [..., 1]
        picks.append(pick)
        choice = choice.masked_fill(columns == pick, float("-inf"))
    return torch.cat(picks, dim=-1)


def losses(
    score_sums: torch.Tensor,
    counts: torch.Tensor,
    z: torch.Tensor | None,
    seq_len: int,
    args: MoEArgs,
    loss_scale: torch.Tensor | float,
    mesh: DeviceMesh | None,
):
    """route()'s statistics of T = b * seq_len tokens -> the Routing fields after the choice: (loss
    scaled by loss_scale, balance_loss, tokens_per_expert, record). mesh: the ranks holding the
    other parts of these sequences (Router.forward's seq_mesh)."""
    k = args.top_k
    T = seq_len * counts.shape[0]
    term, whole = balance_terms(score_sums.sum(0, keepdim=True), counts.sum(0, keepdim=True), T, k, mesh)
    loss = torch.zeros((), dtype=score_sums.dtype, device=score_sums.device)
    if args.load_balance == "aux_loss":
        loss = loss + args.aux_loss_coeff * term[0]
    elif args.load_balance == "seq_aux_loss":
        per_seq, _ = balance_terms(score_sums, counts, seq_len, k, mesh)
        loss = loss + args.aux_loss_coeff * per_seq.mean()
    if z is not None:
        n = 1 if mesh is None else mesh.size()
        loss = loss + args.z_loss_coeff * z / (n * T)
    tokens_per_expert = counts.sum(0).detach().float()  # [E]
    imbalance = tokens_per_expert.max() / tokens_per_expert.mean()
    record = torch.stack([whole[0].float(), torch.zeros_like(imbalance), imbalance, torch.ones_like(imbalance)])
    return loss * loss_scale, whole[0], tokens_per_expert, record


def route_whole(
    logits: torch.Tensor,
    expert_bias: torch.Tensor,
    seq_len: int,
    args: MoEArgs,
    loss_scale: torch.Tensor | float,
    replayed: torch.Tensor | None = None,
):
    """route() and losses() of a rank that holds its sequences whole (no seq_mesh): the Routing
    fields from the logits, one function to compile."""
    probs, experts, score_sums, counts, z, changed = route(
        logits, expert_bias, logits.shape[0] // seq_len, args, replayed
    )
    return probs, experts, *losses(score_sums, counts, z, seq_len, args, loss_scale, None), changed


_COMPILED: dict = {}


def _compiled_on(device: torch.device, fn):
    """fn (route or route_whole) itself on the CPU and inside an enclosing torch.compile; compiled
    once on CUDA (differentiable: the aux losses' gradient reaches the scores) for any number of
    tokens and the model's expert count: only the logits' token dimension is dynamic, so the
    per-token reductions over the experts (softmax, the top-k's argmax passes) are generated for
    their static width. In eager mode one compiled call costs the host less than the dozens of
    small ops it replaces, which the layer's launches wait on (where Triton runs, route_whole's
    own kernels cost it less still: moe/router_triton.py)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return fn
    if fn not in _COMPILED:
        compiled = torch.compile(fn)

        def call(logits, *args):
            maybe_mark_dynamic(logits, 0)
            return compiled(logits, *args)

        _COMPILED[fn] = call
    return _COMPILED[fn]


def balance_terms(score_sums: torch.Tensor, counts: torch.Tensor, T: int, k: int, mesh: DeviceMesh | None):
    """Switch/GShard load balancing E * sum_e f_e * P_e over groups of tokens.

    score_sums [G, E]: per group, the sum of each expert's per-token scores (normalized to sum 1
    per token); counts [G, E]: assignments per expert (no gradient); T tokens and k choices per
    group on this rank. f_e = share of the group's T*k assignments that went to e, P_e = mean
    score of e. `mesh` holds the other parts of the same tokens (cp x tp): f and P are over the
    whole group, so the loss equals the one-rank value; this rank's term carries the gradient of
    its own tokens' scores, and the terms of all ranks of `mesh` add up to the loss.
    Returns (term [G] with gradient, loss [G] detached: the whole group's value).
    """
    num_experts = counts.shape[-1]
    n = 1 if mesh is None else mesh.size()
    both = _group_sum(torch.cat([counts.detach(), score_sums.detach()], dim=-1), mesh)  # [G, 2E]
    f = both[:, :num_experts] / (n * T * k)  # [G, E]
    term = num_experts * (f * score_sums / (n * T)).sum(-1)  # [G]
    loss = num_experts * (f * both[:, num_experts:] / (n * T)).sum(-1)  # [G]
    return term, loss


def limit_to_groups(choice: torch.Tensor, num_groups: int, group_topk: int, pick=top_k_indices) -> torch.Tensor:
    """choice [T, E] with every expert outside the token's group_topk best groups set to -inf.

    The experts form num_groups groups of consecutive ids; a group's score is the sum of its
    two highest choice scores (its best expert alone with one expert per group). pick(scores
    [T, G], k) -> [T, k] columns chooses the groups: by default top_k_indices' argmax passes
    (among groups of equal score the lower id kept first); bench/routing.py passes aten's topk too.
    """
    T, E = choice.shape
    grouped = choice.view(T, num_groups, E // num_groups)  # [T, G, E/G]
    best = min(2, E // num_groups)
    if choice.is_cuda or not torch.compiler.is_compiling():
        # each group's best two by argmax passes: compiled on a GPU, generated with the scores
        group_scores = grouped.gather(-1, top_k_indices(grouped, best)).sum(-1)  # [T, G]
    else:
        # by aten's topk, the same sums: torch 2.11's CPU code generation, fusing those argmax
        # passes with the ones over the groups below, kept the wrong groups
        group_scores = grouped.topk(best, dim=-1).values.sum(-1)
    kept = pick(group_scores, group_topk)  # [T, group_topk]
    keep = (torch.arange(num_groups, device=choice.device) == kept[..., None]).any(-2)  # [T, G]
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)


class Router(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)
        # aux_free: added to the scores for the choice only, never to the combine weights
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)

    def forward(
        self,
        x: torch.Tensor,
        seq_len: int,
        loss_scale: torch.Tensor | float = 1.0,
        seq_mesh: DeviceMesh | None = None,
        replayed: torch.Tensor | None = None,
    ) -> Routing:
        """x [T, dim] with T = b * seq_len tokens, sequences contiguous. seq_mesh: the ranks
        holding the other parts of these sequences (attention cp x tp, the dispatcher's):
        the balance and z losses are computed over all of them. replayed [T, k] int64: the
        experts to take (routing replay), the combine weights the scores at them."""
        args = self.args
        logits = self.gate(x)  # [T, E]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if seq_mesh is None:
            # on a GPU in eager mode two Triton kernels forward, one backward; else route_whole,
            # compiled on a GPU. Replayed experts take route_whole: the kernels choose their own.
            if replayed is None and fused_supported(logits, seq_len):
                return Routing(*fused_route_whole(logits, self.expert_bias, seq_len, args, loss_scale))
            whole = _compiled_on(x.device, route_whole)
            return Routing(*whole(logits, self.expert_bias, seq_len, args, loss_scale, replayed))
        # the statistics' all-reduce over seq_mesh runs between the choice and the losses
        probs, experts, score_sums, counts, z, changed = _compiled_on(x.device, route)(
            logits, self.expert_bias, x.shape[0] // seq_len, args, replayed
        )
        loss, balance_loss, tokens_per_expert, record = losses(
            score_sums, counts, z, seq_len, args, loss_scale, seq_mesh
        )
        return Routing(probs, experts, loss, balance_loss, tokens_per_expert, record, changed)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)
        self.expert_bias.zero_()


class AddAuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, gives `loss` the gradient 1 so it is minimized too.

    Lets the router's losses reach backward without changing the model's output or the
    trainer's loss function.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad_out, torch.ones(shape, dtype=dtype, device=device)
