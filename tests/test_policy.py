"""The policy objective (training.objective = "policy") against a float64 reference written
here: the clipping on both sides, the mask, the truncated importance sampling cap; and the
trainer's token normalisation over micro-batches and dp2 against one rank, with its metrics."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import one_rank_step, train_from_seed

from titan_fold.common.config import parse_args
from titan_fold.data.dataloader import build_dataset
from titan_fold.models.mtp import IGNORE_INDEX
from titan_fold.trainer.policy import PolicyLoss, policy_target
from titan_fold.trainer.preflight import model_args_from_config

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def reference(logits, labels, behaviour, advantages, tis_cap: float) -> torch.Tensor:
    """The loss summed over labelled tokens, token by token in float64."""
    logits = logits.double()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            label = int(labels[i, t])
            if label == IGNORE_INDEX:
                continue
            logp = logits[i, t, label] - torch.logsumexp(logits[i, t], dim=0)
            # with TIS the clipped ratio is against the trainer's own policy (logp detached)
            r = torch.exp(logp - (logp.detach() if tis_cap else float(behaviour[i, t])))
            a = float(advantages[i, t])
            clipped = min(max(r.item(), 1 - CLIP_LOW), 1 + CLIP_HIGH)
            # the clipped side is a constant: no gradient where it is the smaller
            term = -(r * a) if r.item() * a <= clipped * a else torch.tensor(-clipped * a, dtype=torch.float64)
            if tis_cap:
                term = term * min(math.exp(logp.item() - float(behaviour[i, t])), tis_cap)
            total = total + term
    return total


def hand_made_batch():
    """2 sequences x 6 tokens over a vocabulary of 5: behaviour log-probs put the ratio below
    1 - clip_low, inside, and above 1 + clip_high, each with a positive and a negative
    advantage; unlabelled tokens carry advantages and log-probs far off (the mask must drop them)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 5, dtype=torch.float64)
    labels = torch.tensor([[1, 4, 0, IGNORE_INDEX, 2, 3], [IGNORE_INDEX, 2, 2, 1, 0, IGNORE_INDEX]])
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    log_ratio = torch.tensor([[-0.5, 0.0, 0.6, 0.0, -0.5, 0.6], [0.0, 0.22, -0.1, 0.9, -0.9, 0.0]], dtype=torch.float64)
    behaviour = logp - log_ratio
    advantages = torch.tensor([[1.0, -0.7, 1.3, 5.0, -1.1, -0.4], [9.0, 0.8, -1.2, 0.6, 2.0, -7.0]])
    behaviour[labels == IGNORE_INDEX] = -20.0
    return logits, labels, behaviour.float(), advantages


@pytest.mark.parametrize("tis_cap", [0.0, 1.1])
def test_objective_matches_float64_reference(tis_cap):
    logits, labels, behaviour, advantages = hand_made_batch()
    ratio = torch.exp(torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] - behaviour)
    labelled = labels != IGNORE_INDEX
    # the batch holds every case: clipped below and above, with either sign of advantage, and inside
    assert (labelled & (ratio < 1 - CLIP_LOW) & (advantages < 0)).any()
    assert (labelled & (ratio > 1 + CLIP_HIGH) & (advantages > 0)).any()
    assert (labelled & (ratio < 1 - CLIP_LOW) & (advantages > 0)).any()
    assert (labelled & (ratio > 1 + CLIP_HIGH) & (advantages < 0)).any()
    assert (labelled & (ratio > 1 - CLIP_LOW) & (ratio < 1 + CLIP_HIGH)).any()
    # a ratio between 1 + clip_low and 1 + clip_high: a bug clipping with clip_low on both sides shows
    assert (labelled & (ratio > 1 + CLIP_LOW) & (ratio < 1 + CLIP_HIGH) & (advantages > 0)).any()
    if tis_cap:
        assert (labelled & (ratio > tis_cap)).any() and (labelled & (ratio < tis_cap)).any()
    ours = logits.float().clone().requires_grad_()
    loss_fn = PolicyLoss(CLIP_LOW, CLIP_HIGH, tis_cap)
    loss = loss_fn(ours, policy_target(labels, behaviour, advantages))
    loss.backward()
    ref_logits = logits.clone().requires_grad_()
    want = reference(ref_logits, labels, behaviour, advantages, tis_cap)
    want.backward()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.grad.double(), ref_logits.grad, rtol=1e-4, atol=1e-6)
    # the statistics: over the labelled tokens
    sums = loss_fn.stats.values()
    n = int(labelled.sum())
    r = ratio[labelled]
    log_ratio = torch.log(r)
    a = advantages[labelled].double()
    policy_r = torch.ones_like(r) if tis_cap else r
    clipped = (torch.clamp(policy_r, 1 - CLIP_LOW, 1 + CLIP_HIGH) * a) < (policy_r * a)
    want_stats = [r.sum(), clipped.sum(), log_ratio.abs().sum(), (torch.exp(-log_ratio) + log_ratio - 1).sum(), n]
    torch.testing.assert_close(sums[:-1].double(), torch.tensor(want_stats, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert sums[-1].item() == pytest.approx(r.max().item(), rel=1e-5)


@pytest.mark.slow
def test_step_matches_one_rank_under_dp2_micro_batches_cp2_pp2(tmp_path, seed_checkpoint):
    """Two steps on the example rollouts from one seed, their routed experts replayed
    (moe.routing_replay = "rollout"): one rank with one micro-batch of 4 samples against dp2 x ep2
    with 2 micro-batches of 1 sample per rank, cp2 (packed documents dealt in blocks, the ids
    split with their tokens) and pp2 (1F1B, 2 pipeline micro-batches, each stage its own layers'
    ids). The samples hold different numbers of
    labelled tokens, so a mean per micro-batch or per rank gives another loss; the per-token
    inputs must follow their tokens through cp and reach the last stage; the metrics are
    reduced over the ranks."""
    args = ["--training.dataset", "rollouts_example", "--training.dataset_format", "rollouts"]
    args += ["--training.seq_len", "256", "--training.objective", "policy", "--moe.routing_replay", "rollout"]
    args += ["--training.global_batch_size", "4"]
    # no aux or z loss: they are means over each micro-batch
    args += ["--moe.load_balance", "none", "--moe.aux_loss_coeff", "0", "--moe.z_loss_coeff", "0"]
    config = parse_args(["--job.config_file", "debug_moe.toml", *args])
    ds = build_dataset(None, config, model_args_from_config(config)[1])
    counts = [int((ds[g][1] != IGNORE_INDEX).sum()) for g in range(4)]
    assert len(set(counts)) > 1, counts
    whole = ["--training.local_batch_size", "4"]
    one = train_from_seed(tmp_path / "one", 1, seed_checkpoint, 2, *args, *whole)
    runs = {
        "dp2_ep2": ["--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "2"],
        "cp2": [*whole, "--parallelism.context_parallel_degree", "2"],
        "pp2": [*whole, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule"]
        + ["1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2"],
    }
    keys = ("loss", "grad_norm", "policy_ratio_mean", "policy_ratio_max", "policy_clip_frac", "logprob_gap", "kl_k3")
    keys += ("routing_replay_changed",)
    for name, layout in runs.items():
        got = train_from_seed(tmp_path / name, 2, seed_checkpoint, 2, *args, *layout)
        for ref, run in zip(one, got, strict=True):
            for key in keys:
                assert math.isfinite(ref[key]), (key, ref)
                assert run[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (name, key, ref["step"], ref[key])
    # the seed's weights are far from the behaviour log-probs: the clip stops some tokens' gradient;
    # the example's routed experts are not the routers' choice: replay changes most routings
    assert 0 < one[-1]["policy_clip_frac"] < 1 and one[-1]["kl_k3"] > 0
    assert one[-1]["routing_replay_changed"] > 0.5


def _rollout_batch(vocab: int, b: int = 2, s: int = 16, prompts: tuple[int, ...] = (5, 9)):
    """b rollouts of s tokens, each a prompt (unlabelled) then its response; behaviour log-probs
    and advantages per token."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (b, s), generator=gen)
    trained = torch.arange(s)[None] >= torch.tensor(prompts)[:, None]  # [b, s] the response
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = torch.where(trained[:, 1:], tokens[:, 1:], IGNORE_INDEX)
    behaviour = -torch.rand(b, s, generator=gen) * 8
    advantages = torch.randn(b, s, generator=gen)
    return tokens, labels, behaviour, advantages


def test_policy_step_with_mtp_and_replay_against_float64_reference():
    """The trainer's micro-batch (TrainStep._forward_backward) under the policy objective with one
    MTP layer and the rollouts' routing replayed (moe.routing_replay = "rollout"), fp32, against a
    float64 reference written here: gradients of (policy loss + mtp.loss_scaling_factor x the MTP
    layer's cross-entropy over the labelled tokens two ahead) / the labelled tokens, the MTP layer
    reading every token ahead (the prompt too) and routing by its own router, the main MoE layers by
    the replayed ids; mtp_loss the mean of that cross-entropy; routing_replay_changed counting the
    main layers only."""
    import copy
    import dataclasses

    from titan_fold.data.rollouts import ADVANTAGES_KEY, LOGPROBS_KEY
    from titan_fold.models import FLAVORS, Transformer
    from titan_fold.models.mtp import mtp_stats_from, mtp_stats_values
    from titan_fold.moe.layer import moe_stats_from, moe_stats_values

    args = FLAVORS["deepseek_v3"]["debug"]  # layer 0 dense, 1-3 MoE; the MTP layer's block MoE
    moe = dataclasses.replace(args.moe, routing_replay="rollout", load_balance="none")
    args = dataclasses.replace(args, moe=moe, mtp_layers=1, mtp_loss_scaling_factor=0.3)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for m in (m for m in model.modules() if hasattr(m, "router")):
            m.router.gate.weight.normal_(0, 0.5)  # decided routing, not near-ties
    ref = copy.deepcopy(model).double()
    tokens, labels, behaviour, advantages = _rollout_batch(args.vocab_size)
    b, s = tokens.shape
    L, E, k = args.n_moe_layers(), args.moe.num_experts, args.moe.top_k
    routed = torch.rand(b, s, L, E, generator=torch.Generator().manual_seed(4)).argsort(-1)[..., :k]
    n = int((labels != IGNORE_INDEX).sum())

    batch = {"input": tokens, "routed_experts": routed, LOGPROBS_KEY: behaviour, ADVANTAGES_KEY: advantages}
    step = one_rank_step(model, PolicyLoss(CLIP_LOW, CLIP_HIGH))
    loss = step.forward_backward(input_dict=batch, labels=labels, global_valid_tokens=torch.tensor(float(n)))
    mtp_loss = mtp_stats_from(mtp_stats_values(model))["mtp_loss"]
    moe_stats = moe_stats_values(model)

    # the reference: the main model replaying the ids; the MTP layer written out, its router choosing
    hidden = []  # the last layer's output, the MTP layer's input h
    ref.norm.register_forward_hook(lambda m, a, o: hidden.append(a[0]))
    logits = ref(tokens, routed_experts=routed)  # [b, s, vocab]
    layer = ref.mtp.layers["0"]
    ahead = tokens[:, 1:]  # the MTP layer's input at i < s - 1: token i + 1, trained or not
    x = layer.eh_proj(torch.cat([layer.enorm(ref.tok_embeddings(ahead)), layer.hnorm(hidden[0][:, :-1])], -1))
    x = layer.block(x, ref.rope_cos[: s - 1], ref.rope_sin[: s - 1])  # no replayed ids: its router
    mtp_targets = labels[:, 1:]  # token i + 2 where it is trained (the policy's tokens)
    mtp_ce = F.cross_entropy(
        ref.output(layer.norm(x)).flatten(0, 1), mtp_targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    policy = reference(logits, labels, behaviour, advantages, 0.0)
    (policy / n + 0.3 * mtp_ce / n).backward()

    assert loss.item() == pytest.approx(policy.item() / n, rel=1e-5)
    assert mtp_loss == pytest.approx(mtp_ce.item() / int((mtp_targets != IGNORE_INDEX).sum()), rel=1e-5)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        err = (p.grad.double() - want[name].grad).norm() / want[name].grad.norm().clamp_min(1e-30)
        assert err < 1e-4, (name, err.item())
    # every (token, main MoE layer) replayed, the MTP layer's not counted
    assert moe_stats is not None and moe_stats[-1].item() == b * s * L
    assert 0.5 < moe_stats_from(moe_stats)["routing_replay_changed"] < 1
