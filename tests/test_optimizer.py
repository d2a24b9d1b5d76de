"""The one-pass Adam / AdamW step (titan_fold/trainer/optimizer.py) against float64 Adam /
AdamW and torch's fused AdamW, with and without fp32 master weights; the masters under FSDP2
on both meshes against the one-rank run."""

import contextlib
import copy
import shutil
import warnings

import pytest
import torch
import torch.nn as nn
from torchtitan.components.optimizer import build_optimizers as build_titan_optimizers

from titan_fold.checkpoint.files import read_model_tensors
from titan_fold.checkpoint.trusted import read_metadata
from titan_fold.common.config import ConfigError, Optimizer, parse_args
from titan_fold.parallel.clip import clip_grad_norm_, divides_by_grad_scale
from titan_fold.trainer.optimizer import (
    MASTER_KEY,
    AdamOptimizersContainer,
    MasterWeightOptimizersContainer,
    build_optimizers,
)

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

LR, WD, BETAS, EPS = 1e-4, 0.1, (0.9, 0.95), 1e-8


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Linear(48, 8)).to(torch.bfloat16)


def build(model, implementation="for-loop", master_weights=True, name="AdamW"):
    config = Optimizer(
        name=name,
        lr=LR,
        weight_decay=WD,
        beta1=BETAS[0],
        beta2=BETAS[1],
        eps=EPS,
        implementation=implementation,
        master_weights=master_weights,
    )
    return build_optimizers([model], config, parallel_dims=None)


def grads_for(model, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in model.parameters()]


def adam_float64(w, grads_by_step, decoupled=True, lrs=None, scales=None, store=torch.float64):
    """torch.optim.AdamW's update (Adam's with decoupled=False: L2 decay through the gradient)
    in float64: decay, moments, bias-corrected step; at step t the learning rate lrs[t-1]
    (LR by default) and the gradient divided by scales[t-1] (the clip's grad_scale; 1 by
    default); the weight and moments rounded to `store` after every step (where they are
    kept). -> the weight and the two moments."""
    w, m, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)
    for t, g in enumerate(grads_by_step, start=1):
        lr, scale = (lrs[t - 1] if lrs else LR), (scales[t - 1] if scales else 1.0)
        g = g.double() / scale
        if decoupled:
            w = w * (1 - lr * WD)
        else:
            g = g + WD * w
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        denom = (v / (1 - BETAS[1] ** t)).sqrt() + EPS
        w = w - lr / (1 - BETAS[0] ** t) * m / denom
        w, m, v = (x.to(store).double() for x in (w, m, v))
    return w, m, v


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, implementation", [("AdamW", "fused"), ("AdamW", "for-loop"), ("Adam", "foreach")])
def test_master_update_matches_float64(name, implementation, device):
    """Updates of lr 1e-4 are below half a bf16 ulp of most weights: the fp32 masters keep
    them (float64 AdamW / Adam within fp32 rounding), a bf16 optimizer loses them. The
    implementation picks torch's kernel for the bf16 optimizer and the states' first layout;
    on CUDA the master step is one generated kernel."""
    model, steps = make_model().to(device), 6
    start = [p.detach().clone() for p in model.parameters()]
    bf16_model = copy.deepcopy(model)
    opt = build(model, implementation, name=name)
    bf16_opt = build(bf16_model, implementation, master_weights=False, name=name)
    assert isinstance(opt, MasterWeightOptimizersContainer)
    history = []
    for step in range(steps):
        grads = grads_for(model, step)
        history.append(grads)
        opt.zero_grad()
        bf16_opt.zero_grad()
        for p, q, g in zip(model.parameters(), bf16_model.parameters(), grads, strict=True):
            p.grad, q.grad = g.to(device), g.to(device)
        opt.step()
        bf16_opt.step()
    for i, (p, q, m) in enumerate(zip(model.parameters(), bf16_model.parameters(), opt.masters[0], strict=True)):
        ref, _, _ = adam_float64(start[i].cpu(), [h[i] for h in history], decoupled=name == "AdamW")
        p, q, m = p.detach().cpu(), q.detach().cpu(), m.cpu()
        moved = (ref - start[i].cpu().double()).norm()
        assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
        assert ((m.double() - ref).norm() / moved) < 1e-4  # fp32 rounding of the master only
        assert torch.equal(p, m.to(torch.bfloat16))  # the model holds the rounded master
        assert ((q.double() - ref).norm() / moved) > 0.1  # bf16 weights lose the small updates


# the learning rates of 6 steps, as a schedule sets them; the clip's max norm: the gradients'
# norm is ~45 on even steps (clipped: grad_scale ~9), ~0.45 on odd ones (grad_scale 1)
LRS, MAX_NORM = [1e-2, 5e-3, 2e-2, 1e-2, 3e-3, 1e-2], 5.0


def clipped_steps(model, opt, first, steps):
    """Steps first.. of opt over model: grads_for's gradients (a hundredth of them on odd
    steps) in the parameters' dtype, parallel/clip.py's clip at MAX_NORM, the learning rates
    LRS; -> the gradients of every step and the clip's grad_scale."""
    grads_by_step, scales = [], []
    for step in range(first, first + steps):
        opt.zero_grad()
        for p, g in zip(model.parameters(), grads_for(model, step), strict=True):
            p.grad = (g * (0.01 if step % 2 else 1.0)).to(p.device, p.dtype)
        clip_grad_norm_(list(model.parameters()), MAX_NORM, optimizers=opt.optimizers)
        for o in opt.optimizers:
            o.param_groups[0]["lr"] = LRS[step]
        grads_by_step.append([p.grad.cpu().clone() for p in model.parameters()])
        scales.append(opt.optimizers[0].grad_scale.item())
        opt.step()
    return grads_by_step, scales


def ulps(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|x - ref| in units in the last place of dtype at ref (float64)."""
    finfo = torch.finfo(dtype)
    ulp = finfo.eps * 2.0 ** torch.floor(torch.log2(ref.abs().clamp(min=finfo.tiny)))
    return (x.double() - ref).abs() / ulp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_one_pass_update_matches_float64(name, dtype, device):
    """implementation = "fused" without master weights: torch's optimizers stepped by the
    one-pass step (on CUDA one generated kernel per parameter), 6 steps with a changing
    learning rate and the clip's grad_scale, against Adam / AdamW in float64. fp32
    parameters: within fp32 rounding. bf16 parameters: against the float64 update rounded to
    bf16 after every step, where the step stores its weights and moments: an independent
    reference of the same rounding points (torch's fused AdamW is compared in
    test_checkpoint_interop_with_torch_fused_adamw); the step's math is fp32, which tips a
    bf16 rounding the other way now and then: one ulp, in few elements."""
    model = make_model().to(device, dtype)
    start = [p.detach().cpu().clone() for p in model.parameters()]
    opt = build(model, "fused", master_weights=False, name=name)
    assert type(opt) is AdamOptimizersContainer and all(divides_by_grad_scale(o) for o in opt.optimizers)
    grads, scales = clipped_steps(model, opt, 0, len(LRS))
    assert scales[0] > 1 and scales[1] == 1  # clipped, and not
    for i, p in enumerate(model.parameters()):
        state = opt.optimizers[0].state[p]
        assert state["step"].dtype == torch.float32 and state["step"].device == p.device and state["step"] == len(LRS)
        store = torch.float64 if dtype == torch.float32 else dtype
        ref = adam_float64(start[i], [g[i] for g in grads], name == "AdamW", LRS, scales, store)
        assert (ref[0] - start[i].double()).norm() > 0.05 * ref[0].norm()  # the weights moved
        for r, x in zip(ref, (p, state["exp_avg"], state["exp_avg_sq"]), strict=True):
            assert x.dtype == dtype
            x = x.detach().cpu().double()
            if dtype == torch.float32:
                assert (x - r).norm() / r.norm() < 1e-6
            else:
                off = ulps(x, r, dtype)
                assert off.max() <= 1 and (off > 0).double().mean() < 0.01, (off.max(), (off > 0).double().mean())


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("rows, extra", [(2, 37), (3, 0), (1, 5), (0, 9), (0, 0)])
def test_adam_update_steps_every_element_once(rows, extra, device):
    """adam_update (the bulk of a parameter as [rows, ROW], the rest 1-D) against one step over
    the whole flat tensors (the masters' dtypes: bf16 weight and gradient, fp32 master and
    moments). On the CPU: equal to _adam_step. On CUDA (two generated kernels): no further from
    _adam_step run op by op on the CPU than fused(_adam_step) over the flat tensors is, plus one
    rounding. No element missed or stepped twice (either would be off by a whole update)."""
    from titan_fold.common.fused import fused
    from titan_fold.trainer.optimizer import ROW, AdamHyper, _adam_step, adam_update

    n = rows * ROW + extra
    gen = torch.Generator().manual_seed(n)
    tensors = [torch.randn(n, generator=gen) for _ in range(4)] + [torch.rand(n, generator=gen)]
    dtypes = (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.float32)
    got = [t.to(device, dtype, copy=True) for t, dtype in zip(tensors, dtypes, strict=True)]
    flat = [t.clone() for t in got]
    coef = torch.tensor([1e-3, 0.5, 0.99, 0.5])
    adam_update(*got, coef.to(device), AdamHyper(*BETAS, EPS, WD, True))
    if device == "cpu" or not n:
        _adam_step(*flat, coef.to(device), *BETAS, EPS, WD, True)
        assert all(torch.equal(g, f) for g, f in zip(got, flat, strict=True))
    else:
        fused(_adam_step)(*flat, coef.to(device), *BETAS, EPS, WD, True)
        ref = [t.to(dtype) for t, dtype in zip(tensors, dtypes, strict=True)]
        _adam_step(*ref, coef, *BETAS, EPS, WD, True)
        for g, f, r, dtype in zip(got, flat, ref, dtypes, strict=True):
            r = r.double()
            bound = (f.double().cpu() - r).abs().max() + torch.finfo(dtype).eps * r.abs().max()
            assert (g.double().cpu() - r).abs().max() <= bound
    if n:
        assert not torch.equal(got[2].cpu(), tensors[2])  # the master did move


def test_one_pass_skips_parameters_without_gradient():
    """As torch's step: a parameter without a gradient keeps its value and gets no state; an
    empty one (an FSDP shard of none of the rows) steps."""
    model = make_model()
    model.empty = nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
    opt = build(model, "fused", master_weights=False)
    frozen = model[2].bias
    before = frozen.detach().clone()
    for p in model.parameters():
        p.grad = None if p is frozen else torch.ones_like(p)
    opt.step()
    assert torch.equal(frozen, before) and not opt.optimizers[0].state[frozen]
    assert opt.optimizers[0].state[model.empty]["step"] == 1
    assert not torch.equal(model[2].weight.grad, torch.zeros_like(model[2].weight))  # gradients kept for zero_grad


@pytest.mark.parametrize("master_weights", [False, True])
def test_step_hooks_run_once_per_step(master_weights):
    """Step hooks registered on a container run once per step, as torch's Optimizer promises,
    with both containers' classes in use (torch wraps each class's step)."""
    model = make_model()
    opt = build(model, "fused", master_weights=master_weights)
    build(make_model(), "fused", master_weights=not master_weights)
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    opt.register_step_post_hook(lambda *args: calls.append("post"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("implementation, master_weights", [("fused", False), ("fused", True), ("for-loop", False)])
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_guard_keeps_the_weights_of_a_nonfinite_step(policy, implementation, master_weights):
    """Step 2's gradients hold a NaN (so does its norm). The guard raises (stop: NonFiniteError,
    skip: SkippedStep) and the step leaves every weight, moment, master and step count as it was:
    a third step then gives what the same step gives right after step 1, bit for bit. A fused
    step (titan_fold's one pass) is queued behind the verdict with no host read before it and
    the check after it raises; torch's for-loop step takes no verdict, and the check before it
    raises."""
    from host_sync import no_host_sync

    from titan_fold.trainer.guard import NonFiniteError, NonFiniteGuard, SkippedStep

    def run(nan_step: bool):
        model = make_model()
        opt = build(model, implementation, master_weights)
        guard = NonFiniteGuard(policy, torch.device("cpu"))
        guard.watch(opt)
        checks = []

        def guarded_step():  # as the trainer's step (TrainStep._update)
            checks.append("before")
            with no_host_sync() if implementation == "fused" else contextlib.nullcontext():
                guard.before_optimizer_step()
            opt.step()
            checks.append("after")
            guard.after_optimizer_step()

        steps = [1, "nan", 3] if nan_step else [1, 3]
        for step in steps:
            grads = grads_for(model, 2 if step == "nan" else step)
            if step == "nan":
                grads[1][3] = float("nan")
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            norm = torch.stack([g.float().norm() for g in grads]).norm()
            guard.observe_loss(torch.tensor(1.0))
            guard.observe_grad_norm(norm)
            if step == "nan":
                checks.clear()
                with pytest.raises(NonFiniteError if policy == "stop" else SkippedStep):
                    guarded_step()
                assert checks == (["before", "after"] if implementation == "fused" else ["before"])
            else:
                guarded_step()
        state = [t.clone() for o in opt.optimizers for s in o.state.values() for t in s.values()]
        return [p.detach().clone() for p in model.parameters()] + state

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.equal(got, want)


def test_guard_gives_no_verdict_to_optimizers_stepped_in_backward():
    """early_step_in_backward: the optimizers step inside backward, before the guard's check, so
    they get no found_inf (it would skip the next step's update); the check before the step decides."""
    from torchtitan.components.optimizer import OptimizersInBackwardContainer

    from titan_fold.trainer.guard import NonFiniteError, NonFiniteGuard

    model = make_model()
    opt = OptimizersInBackwardContainer([model], torch.optim.AdamW, {"lr": LR, "fused": True})
    guard = NonFiniteGuard("stop", torch.device("cpu"))
    guard.watch(opt)
    assert guard.optimizers == [] and not any(hasattr(o, "found_inf") for o in opt.optimizers)
    guard.observe_loss(torch.tensor(float("nan")))
    with pytest.raises(NonFiniteError):
        guard.before_optimizer_step()


def test_skipped_step_moves_neither_router_bias_nor_lr():
    """training.nonfinite = "skip" over fused AdamW, in the trainer's order (TrainStep._update):
    the verdict is read after the optimizer's kernels are queued, and a skipped step leaves the
    weights, the aux-free router bias and the lr schedule as they were; the next, finite, step
    moves all three."""
    import functools
    import types

    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.config import LRScheduler

    from titan_fold.moe import MoE, MoEArgs, update_expert_bias
    from titan_fold.trainer.guard import NonFiniteGuard, SkippedStep
    from titan_fold.trainer.step import TrainStep

    torch.manual_seed(0)
    moe = MoE(32, MoEArgs(num_experts=4, top_k=2, moe_ffn_dim=16, load_balance="aux_free"))
    moe.init_weights(0.02)
    opt = build(moe, "fused", master_weights=False)
    guard = NonFiniteGuard("skip", torch.device("cpu"))
    guard.watch(opt)
    assert guard.optimizers  # the verdict reaches the optimizers as found_inf: no wait before the step
    trainer = types.SimpleNamespace(
        guard=guard,
        phases=None,
        optimizers=opt,
        model_parts=[moe],
        model_converters=types.SimpleNamespace(post_optimizer_hook=lambda parts: None),
        expert_bias_update=functools.partial(update_expert_bias, [moe]),
        lr_schedulers=build_lr_schedulers(opt, LRScheduler(warmup_steps=4, decay_ratio=None), training_steps=10),
    )

    def state():
        lr = trainer.lr_schedulers.schedulers[0].get_last_lr()[0]
        return [t.detach().clone() for t in (*moe.parameters(), moe.router.expert_bias)], lr

    for finite in (False, True):
        moe(torch.randn(2, 8, 32)).square().sum().backward()  # an uneven expert load
        guard.observe_loss(torch.tensor(1.0 if finite else float("nan")))
        guard.observe_grad_norm(torch.tensor(1.0))
        (*before, bias), lr = state()
        if finite:
            TrainStep._update(trainer, False)
        else:
            with pytest.raises(SkippedStep):
                TrainStep._update(trainer, False)
        (*after, bias_after), lr_after = state()
        weights_moved = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        moved = (weights_moved, not torch.equal(bias, bias_after), lr_after != lr)
        assert moved == (finite,) * 3, f"(weights, bias, lr) moved at a {'finite' if finite else 'skipped'} step"
        opt.zero_grad()


@pytest.mark.parametrize("master_weights", [False, True])
def test_lr_schedulers_see_the_step(master_weights):
    """torchtitan's LR schedulers over the one-pass containers: each scheduler sees its
    optimizer step (torch warns when a scheduler steps before its optimizer did)."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.config import LRScheduler

    model = make_model()
    opt = build(model, "fused", master_weights=master_weights)
    schedulers = build_lr_schedulers(opt, LRScheduler(warmup_steps=2, decay_ratio=None), training_steps=10)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
        opt.step()
        schedulers.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("writer, reader", [("torch", "ours"), ("ours", "torch"), ("ours", "ours")])
def test_checkpoint_interop_with_torch_fused_adamw(writer, reader):
    """The one-pass step keeps torch's fused AdamW's states and torchtitan's state_dict (bf16
    parameters and moments, a float32 step count): a checkpoint of either loads into the
    other (the same keys, the same tensors after loading) and steps on as the writer does,
    with the clip's grad_scale and a changing learning rate: bit for bit by the same step,
    within one bf16 ulp (weights and moments) by the other (torch divides the gradient by
    grad_scale, the one-pass step multiplies it by the reciprocal: fp32 roundings that tip a
    bf16 rounding now and then)."""

    def make(kind, seed):
        model = make_model(seed)
        config = Optimizer(name="AdamW", lr=LR, weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
        opt = (build_titan_optimizers if kind == "torch" else build_optimizers)([model], config, None)
        assert (type(opt) is AdamOptimizersContainer) == (kind == "ours")
        return model, opt

    def states(model, opt):
        return [t.detach() for p in model.parameters() for t in (p, *opt.optimizers[0].state[p].values())]

    model, opt = make(writer, 0)
    clipped_steps(model, opt, 0, 3)
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state_dict().items()}
    assert {
        "state.0.weight.exp_avg",
        "state.0.weight.exp_avg_sq",
        "state.0.weight.step",
        "param_groups.0.weight.lr",
    } <= saved.keys()
    resumed_model, resumed = make(reader, 1)  # other weights: the checkpoint replaces them
    resumed_model.load_state_dict(model.state_dict())
    resumed.load_state_dict(saved)
    loaded = resumed.state_dict()
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == loaded[key].dtype and torch.equal(value, loaded[key]), key
        else:
            assert value == loaded[key], key
    clipped_steps(model, opt, 3, 2)
    clipped_steps(resumed_model, resumed, 3, 2)
    for a, b in zip(states(model, opt), states(resumed_model, resumed), strict=True):
        if writer == reader or a.dtype == torch.float32:  # the step counts
            assert torch.equal(a, b)
        else:
            off = ulps(b, a.double(), a.dtype)
            assert off.max() <= 1 and (off > 0).double().mean() < 0.01, (off.max(), (off > 0).double().mean())


def test_state_dict_round_trip_and_resume():
    model = make_model()
    opt = build(model)
    for step in range(3):
        for p, g in zip(model.parameters(), grads_for(model, step), strict=True):
            p.grad = g
        opt.step()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state_dict().items()}
    assert {
        "state.0.weight.master",
        "state.0.weight.exp_avg",
        "state.0.weight.exp_avg_sq",
        "state.0.weight.step",
        "param_groups.0.weight.lr",
        "state.2.bias.master",
    } <= set(state)

    resumed_model = make_model(seed=1)  # other weights: the checkpoint must replace them
    resumed = build(resumed_model)
    assert resumed.state_dict()["state.0.weight.step"] == 0  # states exist before any step
    resumed.load_state_dict(state)
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for o, model_ in ((opt, model), (resumed, resumed_model)):
        for p, g in zip(model_.parameters(), grads_for(model_, 3), strict=True):
            p.grad = g
        o.step()
    for a, b in zip(opt.masters[0], resumed.masters[0], strict=True):
        assert torch.equal(a, b)


def test_model_only_load_after_build_reaches_the_masters():
    """A seed checkpoint is loaded into the model after the optimizer is built."""
    model = make_model()
    opt = build(model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), make_model(seed=2).parameters(), strict=True):
            p.copy_(q)
    loaded = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # zero gradients: only the decay moves the weights
    for m, w in zip(opt.masters[0], loaded, strict=True):
        assert torch.allclose(m, w.float() * (1 - LR * WD), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--optimizer.master_weights"], "training.dtype = 'float32'"),
        (
            ["--optimizer.master_weights", "--training.dtype", "bfloat16", "--optimizer.early_step_in_backward"],
            "early_step_in_backward",
        ),
    ],
)
def test_config_rejects(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--job.config_file", "debug_moe.toml", *args])


LOSS_STEPS = 100


def _mean_tail(metrics, n=25):
    return sum(m["loss"] for m in metrics[-n:]) / n


def test_debug_model_loss_matches_the_autocast_recipe(tmp_path, seed_checkpoint):
    """bf16 weights with fp32 masters against bf16 autocast over fp32 weights, from the same
    seed checkpoint, 100 steps of the debug model: the mean loss of the last 25 steps differs
    by no more than the autocast recipe's own from another seed checkpoint (run-to-run noise)."""
    from helpers import torchrun, train_from_seed

    batch = ("--training.local_batch_size", "4", "--training.global_batch_size", "4")
    autocast = ("--training.mixed_precision_param", "bfloat16", *batch)
    amp = train_from_seed(tmp_path / "amp", 1, seed_checkpoint, LOSS_STEPS, *autocast)
    masters = train_from_seed(
        tmp_path / "masters",
        1,
        seed_checkpoint,
        LOSS_STEPS,
        "--training.dtype",
        "bfloat16",
        "--optimizer.master_weights",
        *batch,
    )
    torchrun(
        1,
        "--job.dump_folder",
        str(tmp_path / "seed1"),
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        "--debug.seed",
        "1",
    )
    other = train_from_seed(
        tmp_path / "amp_seed1", 1, str(tmp_path / "seed1" / "checkpoint" / "step-0"), LOSS_STEPS, *autocast
    )
    noise = abs(_mean_tail(other) - _mean_tail(amp))
    gap = abs(_mean_tail(masters) - _mean_tail(amp))
    print(
        f"mean loss of the last 25 steps: autocast {_mean_tail(amp):.4f}, masters {_mean_tail(masters):.4f}, "
        f"autocast from another seed {_mean_tail(other):.4f}; gap {gap:.4f}, noise {noise:.4f}"
    )
    assert _mean_tail(masters) < 0.8 * masters[0]["loss"]  # it trains
    assert gap <= max(noise, 0.005 * _mean_tail(amp)), (gap, noise, _mean_tail(amp), _mean_tail(masters))


# 4 ranks, FSDP2 on both meshes: the dense parameters sharded 4 ways over the attention
# mesh's dp_shard, each ep rank's 4 experts 2 ways over the expert mesh's edp (ep 2 x edp 2)
BOTH_MESHES = (
    "--parallelism.data_parallel_shard_degree",
    "4",
    "--parallelism.expert_parallel_degree",
    "2",
    "--parallelism.expert_data_parallel_degree",
    "2",
)
# lr 1e-4 at the end of the warmup: in 4 steps the masters move a few bf16 ulps of most
# weights and a fraction of one of the norms' (1.0), so a master rounded to bf16 on the way
# shows; micro-batches of 2 sequences in both runs (the aux loss is a mean over one);
# checkpoints at steps 2 and 4 with the optimizer's states
SHARDED_STEPS = 4
SHARDED_RUN = (
    "--training.dtype",
    "bfloat16",
    "--optimizer.master_weights",
    "--optimizer.lr",
    "1e-4",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "8",
    "--checkpoint.interval",
    "2",
    "--checkpoint.no-last_save_model_only",
)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory, seed_checkpoint):
    """One rank and FSDP2 on both meshes, from the same seed checkpoint and global batches."""
    from helpers import train_from_seed

    root = tmp_path_factory.mktemp("masters")
    one = train_from_seed(root / "one", 1, seed_checkpoint, SHARDED_STEPS, *SHARDED_RUN)
    sharded = train_from_seed(root / "sharded", 4, seed_checkpoint, SHARDED_STEPS, *SHARDED_RUN, *BOTH_MESHES)
    return root, one, sharded


def saved_masters(folder) -> dict[str, torch.Tensor]:
    """{parameter name: its whole fp32 master} from a DCP checkpoint's optimizer states."""
    import torch.distributed.checkpoint as dcp

    prefix, suffix = "optimizer.state.", f".{MASTER_KEY}"
    metadata = read_metadata(str(folder)).state_dict_metadata
    masters = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith(prefix) and k.endswith(suffix)
    }
    dcp.load(masters, checkpoint_id=str(folder), no_dist=True)
    return {k[len(prefix) : -len(suffix)]: v for k, v in masters.items()}


def test_fsdp2_masters_on_both_meshes_match_one_rank(sharded_runs, seed_checkpoint):
    """The masters of FSDP2-sharded parameters (each rank updates its shard) on both meshes
    against the one-rank run's after 4 steps, parameter by parameter, and the losses.

    The runs differ only in bf16 rounding: one rank sums its 4 micro-batches' gradients in
    bf16, FSDP2 reduce-scatters them in fp32 and rounds the shard to bf16 once; the bf16
    GEMMs see other shapes. A gradient then differs by a few bf16 roundings (2^-8 relative),
    and so does Adam's update m / sqrt(v) (the first one, lr · sign(g), not even that): a
    master's distance from the one-rank master stays within ~5 roundings (2e-2) of the
    distance it moved (measured: at most 5e-3). The mean loss over 1024 tokens moves far
    less than one rounding of a token's (measured: 2e-6 relative; allowed 1e-4); one rank's
    gradient norm is a bf16 number (norms of bf16 gradients), so within two of its ulps
    (2 · 2^-7 relative at most; measured: one).
    """
    root, one, sharded = sharded_runs
    step4 = root / "sharded" / "checkpoint" / "step-4"
    metadata = read_metadata(str(step4)).state_dict_metadata
    # saved by 4 shards each: dense 4 over dp_shard, experts 2 over ep x 2 over edp
    for name in ("layers.0.attention.wq.weight", "layers.0.moe.experts.w13"):
        assert len(metadata[f"optimizer.state.{name}.{MASTER_KEY}"].chunks) == 4, name

    assert [m["step"] for m in one] == [m["step"] for m in sharded] == list(range(1, SHARDED_STEPS + 1))
    for ref, got in zip(one, sharded, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), ref["step"]
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2**-6), ref["step"]

    start = read_model_tensors(seed_checkpoint)  # fp32: the runs start from it rounded to bf16
    ref, got = saved_masters(root / "one" / "checkpoint" / "step-4"), saved_masters(step4)
    weights = read_model_tensors(str(step4))
    assert ref.keys() == got.keys() and got.keys() <= start.keys() & weights.keys()  # start, weights: and buffers
    assert any(".moe.experts." in name for name in got)
    off = {}  # distance from the one-rank master / distance the one-rank master moved
    for name, master in got.items():
        assert master.dtype == torch.float32, name
        assert torch.equal(weights[name], master.to(torch.bfloat16)), name  # the model holds the rounded master
        if name.endswith("attention.wk.bias"):
            # its gradient is ~1e-4 of the other biases' (a key bias shifts all of a query's
            # scores alike but for RoPE, and softmax cancels that): bf16 rounding noise that
            # Adam scales up to whole steps, in both runs
            continue
        moved = (ref[name].double() - start[name].to(torch.bfloat16).double()).norm()
        off[name] = ((master.double() - ref[name].double()).norm() / moved).item()
    assert max(off.values()) <= 2e-2, {name: f"{x:.3g}" for name, x in off.items() if x > 2e-2}
    # the updates below a bf16 ulp stay in the masters: most are no bf16 number
    kept = sum((m != weights[n].float()).sum().item() for n, m in got.items())
    assert kept > 0.5 * sum(m.numel() for m in got.values())


def test_fsdp2_masters_resume_on_both_meshes(sharded_runs, seed_checkpoint, tmp_path):
    """The sharded run's step-2 checkpoint resumed on the same layout: each rank loads its
    shards of the masters (not copies of the bf16 weights, which lack the updates below a
    bf16 ulp), so steps 3 and 4 and the masters at step 4 equal the uninterrupted run's bit
    for bit."""
    from helpers import train_from_seed

    root, _, sharded = sharded_runs
    shutil.copytree(root / "sharded" / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    resumed = train_from_seed(tmp_path, 4, seed_checkpoint, SHARDED_STEPS, *SHARDED_RUN, *BOTH_MESHES)
    keys = ("step", "loss", "grad_norm", "group_grad_norms", "group_update_norms")
    assert [[m[k] for k in keys] for m in resumed] == [[m[k] for k in keys] for m in sharded[2:]]
    ref, got = (
        saved_masters(root / "sharded" / "checkpoint" / "step-4"),
        saved_masters(tmp_path / "checkpoint" / "step-4"),
    )
    assert got.keys() == ref.keys()
    for name, master in got.items():
        assert torch.equal(master, ref[name]), name
