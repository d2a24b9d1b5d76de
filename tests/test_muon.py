"""optimizer.name = "Muon": Muon's update for the hidden matrices against torch.optim.Muon, AdamW's
for the rest against torch.optim.AdamW, and which parameters take which."""

import re

import pytest
import torch

from titan_fold.common.config import parse_args
from titan_fold.models.flavors import FLAVORS
from titan_fold.models.groups import uses_muon
from titan_fold.models.transformer import Transformer
from titan_fold.parallel.orthogonalize import assign_owners, entries_of
from titan_fold.parallel.pipeline import stage_fqns
from titan_fold.trainer.muon import Muon, MuonOptimizersContainer
from titan_fold.trainer.preflight import check_layout, model_args_from_config

SETTINGS = dict(
    lr=0.02,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    momentum=0.95,
    ns_coefficients=(3.4445, -4.775, 2.0315),
    ns_steps=5,
)
STEPS = 3


def muon(named, nesterov=True, lr_adjust="match_rms_adamw", ns_dtype="bfloat16", **changes) -> Muon:
    return Muon(named, **{**SETTINGS, **changes}, nesterov=nesterov, lr_adjust=lr_adjust, ns_dtype=ns_dtype)


def torch_muon(params, nesterov=True, lr_adjust="match_rms_adamw") -> torch.optim.Muon:
    s = SETTINGS
    return torch.optim.Muon(
        params,
        lr=s["lr"],
        weight_decay=s["weight_decay"],
        momentum=s["momentum"],
        nesterov=nesterov,
        ns_coefficients=s["ns_coefficients"],
        ns_steps=s["ns_steps"],
        adjust_lr_fn=lr_adjust,
    )


def steps(pairs, optimizers, seed=0):
    """STEPS steps of every optimizer, each of pairs' (ours, reference) parameters given the same
    random gradient."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        for ours, ref in pairs:
            g = torch.randn(ours.shape, generator=gen)
            ours.grad, ref.grad = g.clone(), g.clone()
        for opt in optimizers:
            opt.step()


def copies(shapes, seed=1) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


@pytest.mark.parametrize("nesterov, lr_adjust", [(True, "match_rms_adamw"), (False, "original")])
def test_matrices_step_as_torch_muon(nesterov, lr_adjust):
    """Square, wide and tall matrices (Newton-Schulz transposes the tall ones): torch's very ops."""
    ours, ref = copies([(24, 24), (16, 40), (40, 16)])
    before = [p.detach().clone() for p in ours]
    named = [(f"layers.0.attention.w{i}.weight", p) for i, p in enumerate(ours)]
    steps(list(zip(ours, ref, strict=True)), [muon(named, nesterov, lr_adjust), torch_muon(ref, nesterov, lr_adjust)])
    for p, r, p0 in zip(ours, ref, before, strict=True):
        assert torch.equal(p, r) and not torch.equal(p, p0)


def test_each_expert_matrix_steps_as_torch_muon():
    """A stack w13 [E, 2 * ffn, dim] is E experts' gate and up matrices [ffn, dim] (rows
    alternating), each orthogonalized on its own; w2 [E, dim, ffn] is E matrices."""
    experts, ffn, dim = 3, 8, 20
    (w13, w2), _ = copies([(experts, 2 * ffn, dim), (experts, dim, ffn)])
    gate = [torch.nn.Parameter(w13.detach()[e, 0::2].clone()) for e in range(experts)]
    up = [torch.nn.Parameter(w13.detach()[e, 1::2].clone()) for e in range(experts)]
    down = [torch.nn.Parameter(w2.detach()[e].clone()) for e in range(experts)]
    before = [t.detach().clone() for t in (*gate, *up, *down)]
    opt = muon([("layers.0.moe.experts.w13", w13), ("layers.0.moe.experts.w2", w2)])
    ref = torch_muon(gate + up + down)
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        w13.grad, w2.grad = torch.randn(w13.shape, generator=gen), torch.randn(w2.shape, generator=gen)
        for e in range(experts):
            gate[e].grad, up[e].grad, down[e].grad = w13.grad[e, 0::2], w13.grad[e, 1::2], w2.grad[e]
        opt.step()
        ref.step()
    got = [w13.detach()[e, 0::2] for e in range(experts)] + [w13.detach()[e, 1::2] for e in range(experts)]
    got += [w2.detach()[e] for e in range(experts)]
    for g, want, w0 in zip(got, [*gate, *up, *down], before, strict=True):
        # both in bf16, ours batched (baddbmm), torch one matrix at a time (addmm)
        change, want_change = g - w0, want.detach() - w0
        assert (change - want_change).norm() < 1e-3 * want_change.norm()


def test_other_parameters_step_as_torch_adamw():
    ours, ref = copies([(30, 8), (8,), (1, 8)])
    named = [
        ("tok_embeddings.weight", ours[0]),
        ("layers.0.attention.wq.bias", ours[1]),
        ("layers.0.moe.shared_expert_gate.weight", ours[2]),
    ]
    opt = muon(named)
    assert [(g["muon"], g["params"]) for g in opt.param_groups] == [(True, []), (False, ours)]
    adamw = torch.optim.AdamW(
        ref, lr=SETTINGS["lr"], betas=SETTINGS["betas"], eps=SETTINGS["eps"], weight_decay=SETTINGS["weight_decay"]
    )
    steps(list(zip(ours, ref, strict=True)), [opt, adamw])
    for p, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_split_of_the_debug_models(family):
    """Muon: the attention projections (MLA's too), the FFNs and shared experts, the routed experts;
    AdamW: embedding, head, norms, router, the shared expert's gate and biases."""
    with torch.device("meta"):
        model = Transformer(FLAVORS[family]["debug"])
    split = {name: uses_muon(name, p) for name, p in model.named_parameters()}
    want_muon = {
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "moe.experts.w13",
        "moe.experts.w2",
        "moe.shared_expert.w1.weight",
        "moe.shared_expert.w2.weight",
        "moe.shared_expert.w3.weight",
    }
    if family == "deepseek_v3":
        want_muon = {
            "attention.wq_a.weight",
            "attention.wq_b.weight",
            "attention.wkv_a.weight",
            "attention.wkv_b.weight",
            "attention.wk_rope.weight",
            "attention.wo.weight",
            "feed_forward.w1.weight",
            "feed_forward.w2.weight",
            "feed_forward.w3.weight",
            "moe.experts.w13",
            "moe.experts.w2",
            "moe.shared_expert.w1.weight",
            "moe.shared_expert.w2.weight",
            "moe.shared_expert.w3.weight",
        }
    got_muon = {name.split(".", 2)[2] for name, muon_ in split.items() if muon_}
    assert got_muon == want_muon
    assert not any(split[n] for n in split if not n.startswith("layers."))  # embedding, head, final norm


def test_banner_line_counts_each_update():
    """The banner's split: per update, its parameters' elements and how many of each group."""
    args = FLAVORS["qwen2_moe"]["debug"]
    model = Transformer(args)
    kwargs = dict(SETTINGS, nesterov=True, lr_adjust="match_rms_adamw", ns_dtype="bfloat16")
    line = MuonOptimizersContainer([model], kwargs).split()
    n = args.n_layers
    matrices = sum(
        p.numel()
        for name, p in model.named_parameters()
        if re.search(r"\.(wq|wk|wv|wo|w1|w2|w3|w13)(\.weight)?$", name)
    )
    rest = sum(p.numel() for p in model.parameters()) - matrices
    assert line == (
        f"muon {matrices / 1e6:.2f}M params: attention {4 * n}, routed_experts {2 * n}, shared_experts "
        f"{3 * n}; adamw {rest / 1e6:.2f}M params: attention {3 * n}, embedding 1, head 1, norms "
        f"{2 * n + 1}, router {n}, shared_experts {n}"
    )


# the real-size configs at the world sizes they are written for
PACKAGED = [
    ("deepseek_v3_16b.toml", 8),
    ("deepseek_v3_671b.toml", 1024),
    ("qwen3_30b_a3b.toml", 8),
    ("qwen2.toml", 64),
    ("mixtral_8x22b.toml", 128),
    ("mixtral_8x22b_g8t8.toml", 128),
]


@pytest.mark.parametrize("name, world", PACKAGED)
def test_owners_spread_newton_schulz_on_packaged_configs(name, world):
    """No rank of a pipeline stage owns more than 1.5x the mean Newton-Schulz FLOPs of the stage's
    Muon parameters (attention's and the experts' meshes both span the stage's ranks)."""
    config = parse_args(["--job.config_file", name])
    layout = check_layout(config, world)
    args = model_args_from_config(config)[1]
    with torch.device("meta"):
        model = Transformer(args)
    named = [(n, p) for n, p in model.named_parameters() if uses_muon(n, p)]
    stages = stage_fqns(config.parallelism, args.n_layers, layout.pp) if layout.pp > 1 else [[""]]
    ranks = list(range(world // layout.pp))
    held = 0
    for stage in stages:
        part = [(n, p) for n, p in named if any(n.startswith(f"{m}.") or not m for m in stage)]
        held += len(part)
        loads = assign_owners(entries_of(part, config.optimizer.muon_ns_steps), lambda e: ranks)
        assert len(loads) == len(ranks) and max(loads.values()) <= 1.5 * sum(loads.values()) / len(ranks), stage
    assert held == len(named)  # every stage counted
