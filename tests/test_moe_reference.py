"""Independent float64 per-token reference of the MoE layer, for the tests.

Written without the layer's code: Python loops over tokens and experts, dictionaries for
the drop decision. Decisions are taken on detached values; the arithmetic goes through
autograd so gradients can be compared as well.
"""

import math

import torch
import torch.nn.functional as F


def route_token(logits_t, args, bias):
    """-> (scores [E] tensor, chosen expert ids list, probs list of 0-d tensors)."""
    scores = logits_t.softmax(-1) if args.score_func == "softmax" else logits_t.sigmoid()
    choice = [float(v) for v in scores.detach()]
    if args.load_balance == "aux_free":
        choice = [c + float(b) for c, b in zip(choice, bias, strict=True)]
    chosen = sorted(range(len(choice)), key=lambda e: -choice[e])[: args.top_k]
    probs = [scores[e] for e in chosen]
    if args.norm_topk_prob:
        total = sum(probs)
        probs = [p / total for p in probs]
    return scores, chosen, probs


def drop_decisions(chosen, probs, num_experts, cap, policy):
    """chosen/probs: per token lists -> set of kept (t, j)."""
    kept = set()
    for e in range(num_experts):
        mine = [(t, j) for t in range(len(chosen)) for j in range(len(chosen[t])) if chosen[t][j] == e]
        if policy == "probs":
            mine.sort(key=lambda tj: (-float(probs[tj[0]][tj[1]].detach()), tj[0] * len(chosen[0]) + tj[1]))
        kept.update(mine[:cap])
    return kept


def expert_ffn(x_t, w13, w2, e, p, prob_before_w2):
    # w13 [E, 2 * ffn, dim]: rows 2f and 2f + 1 are hidden unit f's gate and up projections
    h = F.silu(w13[e, 0::2] @ x_t) * (w13[e, 1::2] @ x_t)
    return w2[e] @ (h * p) if prob_before_w2 else (w2[e] @ h) * p


def reference_moe(x, gate, w13, w2, args, bias=None, chunks=1, full_tokens=None):
    """x [T, dim]; gate [E, dim]; full expert weights. Returns (y [T, dim], kept set, chosen).

    chunks: split the tokens into this many equal groups that decide capacity separately
    (sub-sequence dropping on `chunks` ranks). Shared experts are not included.
    """
    T = x.shape[0]
    E = gate.shape[0]
    bias = [0.0] * E if bias is None else list(bias)
    chosen, probs = [], []
    for t in range(T):
        _, c, p = route_token(gate @ x[t], args, bias)
        chosen.append(c)
        probs.append(p)
    if args.capacity_factor is None:
        kept = {(t, j) for t in range(T) for j in range(args.top_k)}
    else:
        kept = set()
        n = T // chunks
        for i in range(chunks):
            cap = math.ceil(n * args.top_k * args.capacity_factor / E)
            part = drop_decisions(chosen[i * n : (i + 1) * n], probs[i * n : (i + 1) * n], E, cap, args.drop_policy)
            kept.update((t + i * n, j) for t, j in part)
    rows = []
    for t in range(T):
        y_t = torch.zeros_like(x[t])
        for j, e in enumerate(chosen[t]):
            if (t, j) in kept:
                y_t = y_t + expert_ffn(x[t], w13, w2, e, probs[t][j], args.prob_before_w2)
        rows.append(y_t)
    return torch.stack(rows), kept, chosen
