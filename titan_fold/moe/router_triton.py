"""The router's route_whole as two Triton kernels forward and one backward (CUDA, eager mode).

moe/router.py's route_whole compiled by torch.compile launches a dozen small kernels forward
for the statistics beside the one that scores and chooses, and four backward (bench/routing.py
counts them), and its compiled call costs the host more than those launches: in eager mode the
layer's launches wait on it. Here, per block of tokens of one sequence, one kernel computes the
scores (softmax or sigmoid), adds the aux-free bias to the choice, keeps the best groups
(DeepSeek-V3), makes the k argmax passes, normalizes and scales the combine weights, and writes
the block's sums of each expert's scores and assignments and of the tokens' logsumexp^2; a
second kernel, one program, sums the blocks per sequence and computes the balance and z losses
and the statistics. Backward is one kernel per block: the combine weights' gradient through the
normalization, the balance loss's and the z loss's, through the softmax or sigmoid. No atomics:
the same bits every run.

The same choices, the same ties (the lower expert id first, among groups the lower group id
first) and, in float32, the same weights, losses and gradients within rounding as route_whole
(tests/test_moe_fast_paths.py compares them on a GPU and in Triton's interpreter on the CPU).
"""

import torch

from titan_fold.moe.args import MoEArgs

try:
    import triton
    import triton.language as tl
except ImportError:  # a platform without Triton's wheel: route_whole compiled instead
    triton = None

_ELEMENTS = 4096  # a block's tokens x experts held at once: registers, not spills


def supported(logits: torch.Tensor, seq_len: int) -> bool:
    """Whether the router runs these logits through fused_route_whole: float32 on a GPU, Triton
    installed, outside torch.compile (which traces route_whole into the model's graph)."""
    return (
        triton is not None
        and logits.is_cuda
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[0] % seq_len == 0
        and not torch.compiler.is_compiling()
    )


def _block_tokens(seq_len: int, experts_p2: int) -> int:
    # a power of two dividing seq_len, so that a block holds tokens of one sequence
    return min(max(1, _ELEMENTS // experts_p2), seq_len & -seq_len)


def _mode(args: MoEArgs) -> int:
    return {"aux_loss": 1, "seq_aux_loss": 2}.get(args.load_balance, 0)


class _FusedRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, expert_bias, loss_scale, seq_len, args):
        T, E = logits.shape
        k, b = args.top_k, T // seq_len
        E_P2, K_P2 = triton.next_power_of_2(E), triton.next_power_of_2(k)
        G = max(args.num_groups, 1)
        BLOCK_T = _block_tokens(seq_len, E_P2)
        blocks = T // BLOCK_T
        logits = logits.contiguous()
        probs = logits.new_empty(T, k)
        experts = torch.empty(T, k, dtype=torch.int64, device=logits.device)
        score_part, count_part = logits.new_empty(blocks, E), logits.new_empty(blocks, E)
        z_part = logits.new_empty(blocks)
        z = args.z_loss_coeff > 0
        _route_forward[(blocks,)](
            logits,
            expert_bias.float().contiguous(),
            probs,
            experts,
            score_part,
            count_part,
            z_part,
            float(args.routed_scaling_factor),
            E=E,
            E_P2=E_P2,
            K=k,
            K_P2=K_P2,
            SOFTMAX=args.score_func == "softmax",
            BIAS=args.load_balance == "aux_free",
            GROUPS=G,
            GROUP_SIZE=E // G,
            G_P2=triton.next_power_of_2(G),
            GROUP_TOPK=args.group_topk or G,
            NORM=args.norm_topk_prob,
            Z=z,
            BLOCK_T=BLOCK_T,
        )
        loss, balance, record, tokens_per_expert = (logits.new_empty(n) for n in ((), (), 4, E))
        f = logits.new_empty(b, E)  # the balance loss's assignment shares: its gradient's coefficients
        # the loss scale: a tensor (MoE.aux_loss_scale) read by the kernels, or a number passed to them
        ctx.scale = loss_scale if torch.is_tensor(loss_scale) else float(loss_scale)
        scale_ptr, scale_value = _scale_args(ctx.scale, f)
        _route_losses[(1,)](
            score_part,
            count_part,
            z_part,
            scale_ptr,
            scale_value,
            loss,
            balance,
            tokens_per_expert,
            record,
            f,
            seq_len,
            float(args.aux_loss_coeff),
            float(args.z_loss_coeff),
            E=E,
            E_P2=E_P2,
            K=k,
            MODE=_mode(args),
            Z=z,
            NUM_SEQS=b,
            BLOCKS_PER_SEQ=seq_len // BLOCK_T,
            BLOCKS_P2=triton.next_power_of_2(blocks),
            SCALE_TENSOR=torch.is_tensor(ctx.scale),
        )
        ctx.save_for_backward(logits, experts, f)
        ctx.seq_len, ctx.args, ctx.block_t = seq_len, args, BLOCK_T
        ctx.mark_non_differentiable(experts, balance, tokens_per_expert, record)
        ctx.set_materialize_grads(False)  # no zeros made for the outputs backward gets no gradient of
        return probs, experts, loss, balance, tokens_per_expert, record

    @staticmethod
    def backward(ctx, g_probs, _experts, g_loss, _balance, _tokens_per_expert, _record):
        logits, experts, f = ctx.saved_tensors
        args = ctx.args
        T, E = logits.shape
        k = args.top_k
        g_probs = torch.zeros(T, k, device=logits.device) if g_probs is None else g_probs.float().contiguous()
        scale_ptr, scale_value = _scale_args(ctx.scale, f)
        d_logits = torch.empty_like(logits)
        _route_backward[(T // ctx.block_t,)](
            logits,
            experts,
            g_probs,
            f if g_loss is None else g_loss.float().reshape(()),
            scale_ptr,
            scale_value,
            f,
            d_logits,
            ctx.seq_len,
            T // ctx.seq_len,
            float(args.routed_scaling_factor),
            float(args.aux_loss_coeff),
            float(args.z_loss_coeff),
            E=E,
            E_P2=triton.next_power_of_2(E),
            K=k,
            K_P2=triton.next_power_of_2(k),
            SOFTMAX=args.score_func == "softmax",
            NORM=args.norm_topk_prob,
            MODE=_mode(args),
            Z=args.z_loss_coeff > 0,
            LOSS_GRAD=g_loss is not None,
            SCALE_TENSOR=torch.is_tensor(ctx.scale),
            BLOCK_T=ctx.block_t,
        )
        return d_logits, None, None, None, None


def _scale_args(scale, placeholder: torch.Tensor) -> tuple:
    # (pointer, number): a tensor scale is read from its pointer, a number passed as is (the
    # other argument then unread: a placeholder)
    return (scale, 1.0) if torch.is_tensor(scale) else (placeholder, scale)


def fused_route_whole(
    logits: torch.Tensor, expert_bias: torch.Tensor, seq_len: int, args: MoEArgs, loss_scale: torch.Tensor | float
):
    """route_whole (moe/router.py) of float32 logits [T, E] as Triton kernels: (probs [T, k],
    experts [T, k], loss, balance_loss, tokens_per_expert [E], record [4], changed None); only where
    supported(). The kernels make their own choice: routing replay takes route_whole (Router.forward)."""
    return (*_FusedRoute.apply(logits, expert_bias, loss_scale, seq_len, args), None)


if triton is not None:

    @triton.jit
    def _scores(logits_ptr, rows, cols, E: tl.constexpr, SOFTMAX: tl.constexpr):
        """A block's logits [BLOCK_T, E_P2] (-inf past E) -> (scores, softmax, the rows' max and sum
        of exp(logit - max): their logsumexp)."""
        col_ok = cols < E
        logits = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=col_ok[None, :], other=float("-inf"))
        top = tl.max(logits, axis=1)
        ex = tl.exp(logits - top[:, None])
        total = tl.sum(ex, axis=1)
        softmax = ex / total[:, None]
        if SOFTMAX:
            scores = softmax
        else:
            scores = tl.where(col_ok[None, :], tl.sigmoid(logits), 0.0)
        return scores, softmax, top, total

    @triton.jit
    def _first_max(x, cols):
        """x [BLOCK_T, N], cols [N] its columns -> [BLOCK_T] int32: the column of each row's largest
        entry, the lowest among equal ones (top_k_indices' rule). Decided here, not by tl.argmax's
        tie_break_left, which Triton's interpreter ignores: so its run on the CPU checks the rule."""
        top = tl.max(x, axis=1)
        return tl.min(tl.where(x == top[:, None], cols[None, :], x.shape[1]), axis=1)

    @triton.jit
    def _route_forward(
        logits_ptr,
        bias_ptr,
        probs_ptr,
        experts_ptr,
        score_part_ptr,
        count_part_ptr,
        z_part_ptr,
        routed_scale,
        E: tl.constexpr,
        E_P2: tl.constexpr,
        K: tl.constexpr,
        K_P2: tl.constexpr,
        SOFTMAX: tl.constexpr,
        BIAS: tl.constexpr,
        GROUPS: tl.constexpr,
        GROUP_SIZE: tl.constexpr,
        G_P2: tl.constexpr,
        GROUP_TOPK: tl.constexpr,
        NORM: tl.constexpr,
        Z: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        block = tl.program_id(0)
        rows = block * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] tokens
        cols = tl.arange(0, E_P2)  # [E_P2] experts
        col_ok = cols < E
        scores, _, top, total = _scores(logits_ptr, rows, cols, E, SOFTMAX)
        choice = scores
        if BIAS:
            choice = choice + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
        choice = tl.where(col_ok[None, :], choice, float("-inf"))
        nothing = (rows[:, None] < 0) & (cols[None, :] < 0)  # [BLOCK_T, E_P2] all False
        if GROUPS > 1:
            group = cols // GROUP_SIZE
            gcols = tl.arange(0, G_P2)
            group_score = tl.full([BLOCK_T, G_P2], float("-inf"), tl.float32)
            for g in tl.static_range(GROUPS):
                in_group = tl.where((group == g)[None, :], choice, float("-inf"))
                best = tl.max(in_group, axis=1)
                if GROUP_SIZE > 1:  # plus the second best (of equal best ones, either: the same sum)
                    first = _first_max(in_group, cols)
                    best = best + tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), in_group), axis=1)
                group_score = tl.where(gcols[None, :] == g, best[:, None], group_score)
            keep = nothing
            for _ in tl.static_range(GROUP_TOPK):
                kept = _first_max(group_score, gcols)
                group_score = tl.where(gcols[None, :] == kept[:, None], float("-inf"), group_score)
                keep = keep | (group[None, :] == kept[:, None])
            choice = tl.where(keep, choice, float("-inf"))
        kcols = tl.arange(0, K_P2)
        chosen = nothing
        probs = tl.zeros([BLOCK_T, K_P2], tl.float32)
        picks = tl.zeros([BLOCK_T, K_P2], tl.int32)
        for j in tl.static_range(K):
            pick = _first_max(choice, cols)  # [BLOCK_T]
            hit = cols[None, :] == pick[:, None]
            chosen = chosen | hit
            choice = tl.where(hit, float("-inf"), choice)
            probs = tl.where(kcols[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], probs)
            picks = tl.where(kcols[None, :] == j, pick[:, None], picks)
        if NORM:
            probs = probs / tl.sum(probs, axis=1)[:, None]
        probs = probs * routed_scale
        out = rows[:, None] * K + kcols[None, :]
        tl.store(probs_ptr + out, probs, mask=kcols[None, :] < K)
        tl.store(experts_ptr + out, picks.to(tl.int64), mask=kcols[None, :] < K)
        # the balance losses see scores that sum to 1 per token (sigmoid scores do not)
        dist = scores if SOFTMAX else scores / tl.sum(scores, axis=1)[:, None]
        tl.store(score_part_ptr + block * E + cols, tl.sum(dist, axis=0), mask=col_ok)
        tl.store(count_part_ptr + block * E + cols, tl.sum(chosen.to(tl.float32), axis=0), mask=col_ok)
        if Z:
            lse = top + tl.log(total)
            tl.store(z_part_ptr + block, tl.sum(lse * lse, axis=0))

    @triton.jit
    def _route_losses(
        score_part_ptr,
        count_part_ptr,
        z_part_ptr,
        scale_ptr,
        scale_value,
        loss_ptr,
        balance_ptr,
        tpe_ptr,
        record_ptr,
        f_ptr,
        seq_len,
        aux_coeff,
        z_coeff,
        E: tl.constexpr,
        E_P2: tl.constexpr,
        K: tl.constexpr,
        MODE: tl.constexpr,
        Z: tl.constexpr,
        NUM_SEQS: tl.constexpr,
        BLOCKS_PER_SEQ: tl.constexpr,
        BLOCKS_P2: tl.constexpr,
        SCALE_TENSOR: tl.constexpr,
    ):
        # one program: the blocks' sums, per sequence (a batch's shape: compiled once per run)
        cols = tl.arange(0, E_P2)
        col_ok = cols < E
        T = NUM_SEQS * seq_len
        scores = tl.zeros([E_P2], tl.float32)
        counts = tl.zeros([E_P2], tl.float32)
        seq_terms = 0.0
        for s in range(NUM_SEQS):
            seq_scores = tl.zeros([E_P2], tl.float32)
            seq_counts = tl.zeros([E_P2], tl.float32)
            for i in range(BLOCKS_PER_SEQ):
                at = (s * BLOCKS_PER_SEQ + i) * E + cols
                seq_scores += tl.load(score_part_ptr + at, mask=col_ok, other=0.0)
                seq_counts += tl.load(count_part_ptr + at, mask=col_ok, other=0.0)
            if MODE == 2:  # seq_aux_loss: E * sum_e f_e P_e per sequence, then their mean
                f = seq_counts / (seq_len * K)
                seq_terms += E * tl.sum(f * seq_scores / seq_len, axis=0)
                tl.store(f_ptr + s * E + cols, f, mask=col_ok)
            scores += seq_scores
            counts += seq_counts
        f = counts / (T * K)
        whole = E * tl.sum(f * scores / T, axis=0)
        loss = 0.0
        if MODE == 1:
            loss = aux_coeff * whole
            tl.store(f_ptr + cols, f, mask=col_ok)
        if MODE == 2:
            loss = aux_coeff * seq_terms / NUM_SEQS
        if Z:
            blocks = tl.arange(0, BLOCKS_P2)
            z = tl.sum(tl.load(z_part_ptr + blocks, mask=blocks < NUM_SEQS * BLOCKS_PER_SEQ, other=0.0), axis=0)
            loss += z_coeff * z / T
        if SCALE_TENSOR:
            loss = loss * tl.load(scale_ptr)
        else:
            loss = loss * scale_value
        tl.store(loss_ptr, loss)
        tl.store(balance_ptr, whole)
        tl.store(tpe_ptr + cols, counts, mask=col_ok)
        imbalance = tl.max(tl.where(col_ok, counts, float("-inf")), axis=0) / (tl.sum(counts, axis=0) / E)
        four = tl.arange(0, 4)
        record = tl.where(four == 0, whole, tl.where(four == 2, imbalance, tl.where(four == 3, 1.0, 0.0)))
        tl.store(record_ptr + four, record)

    @triton.jit
    def _route_backward(
        logits_ptr,
        experts_ptr,
        g_probs_ptr,
        g_loss_ptr,
        scale_ptr,
        scale_value,
        f_ptr,
        d_logits_ptr,
        seq_len,
        num_seqs,
        routed_scale,
        aux_coeff,
        z_coeff,
        E: tl.constexpr,
        E_P2: tl.constexpr,
        K: tl.constexpr,
        K_P2: tl.constexpr,
        SOFTMAX: tl.constexpr,
        NORM: tl.constexpr,
        MODE: tl.constexpr,
        Z: tl.constexpr,
        LOSS_GRAD: tl.constexpr,
        SCALE_TENSOR: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        block = tl.program_id(0)
        rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, E_P2)
        col_ok = cols < E
        kcols = tl.arange(0, K_P2)
        k_ok = kcols[None, :] < K
        scores, softmax, top, total = _scores(logits_ptr, rows, cols, E, SOFTMAX)
        at = rows[:, None] * K + kcols[None, :]
        picks = tl.load(experts_ptr + at, mask=k_ok, other=-1).to(tl.int32)  # [BLOCK_T, K_P2]
        g = tl.load(g_probs_ptr + at, mask=k_ok, other=0.0)
        # probs = routed_scale * raw / sum(raw) (NORM) or routed_scale * raw, raw_j = scores[pick_j];
        # slot [BLOCK_T, E_P2]: the choice j that picked each expert (-1: none)
        raw = tl.zeros([BLOCK_T, K_P2], tl.float32)
        slot = tl.full([BLOCK_T, E_P2], -1, tl.int32)
        for j in tl.static_range(K):
            hit = cols[None, :] == tl.sum(tl.where(kcols[None, :] == j, picks, 0), axis=1)[:, None]
            slot = tl.where(hit, j, slot)
            raw = tl.where(kcols[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], raw)
        if NORM:
            norm = tl.sum(raw, axis=1)
            d_raw = routed_scale * (g / norm[:, None] - (tl.sum(g * raw, axis=1) / (norm * norm))[:, None])
        else:
            d_raw = routed_scale * g
        d_scores = tl.zeros([BLOCK_T, E_P2], tl.float32)
        for j in tl.static_range(K):
            d_j = tl.sum(tl.where(kcols[None, :] == j, d_raw, 0.0), axis=1)
            d_scores += tl.where(slot == j, d_j[:, None], 0.0)
        # the losses' part: their gradient (none where backward got none) times the loss scale
        g_loss = 0.0
        if LOSS_GRAD:
            g_loss = tl.load(g_loss_ptr)
            if SCALE_TENSOR:
                g_loss = g_loss * tl.load(scale_ptr)
            else:
                g_loss = g_loss * scale_value
        if LOSS_GRAD and MODE != 0:
            # d loss / d dist[t, e] = coeff * E * f_e / T, f over all T tokens (aux_loss) or, as
            # the mean over the sequences of their terms, f of t's sequence (seq_aux_loss)
            seq = (block * BLOCK_T) // seq_len if MODE == 2 else 0
            f = tl.load(f_ptr + seq * E + cols, mask=col_ok, other=0.0)
            d_dist = (aux_coeff * g_loss * E / (num_seqs * seq_len)) * f
            if SOFTMAX:
                d_scores += d_dist[None, :]
            else:  # dist = scores / sum(scores)
                norm = tl.sum(scores, axis=1)
                dist = scores / norm[:, None]
                d_scores += (d_dist[None, :] - tl.sum(dist * d_dist[None, :], axis=1)[:, None]) / norm[:, None]
        if SOFTMAX:
            d_logits = scores * (d_scores - tl.sum(d_scores * scores, axis=1)[:, None])
        else:
            d_logits = d_scores * scores * (1.0 - scores)
        if LOSS_GRAD and Z:  # z = sum_t logsumexp_t^2 / T: 2 * logsumexp * softmax
            lse = top + tl.log(total)
            d_logits += (z_coeff * g_loss * 2.0 / (num_seqs * seq_len)) * lse[:, None] * softmax
        tl.store(d_logits_ptr + rows[:, None] * E + cols[None, :], d_logits, mask=col_ok[None, :])
