"""The RL loop's Python entry point (titan_fold/api.py) at one rank, on the debug model from the seed
checkpoint: logprobs equal the model's own log-softmax at the tokens, each record run alone;
train_step's loss is the mean negative log-prob of the loss_mask tokens at the weights before the
step, and the step changes the weights; save then from_config resumes the same weights and step;
save_hub refuses a non-empty folder and otherwise writes the streamed tensors; under recorded
replay (R2) the step after a logprobs pass replays that pass's routing, even after the routers
changed. The stream under foldings: tests/test_stream.py."""

import json
import os

import pytest
import torch
from launcher import run_ranks

pytestmark = pytest.mark.slow

# records of different lengths, packed two to a row of 32 tokens: positions past the first
# record of a row see a masked neighbour
RECORDS = [
    {"tokens": [5, 9, 17, 33, 2, 71, 8, 8, 40, 11, 3, 99, 250, 7], "loss_mask": [0] * 5 + [1] * 9},
    {"tokens": [300, 12, 4, 4, 61, 18, 200, 5, 1, 77, 31, 6], "loss_mask": [0] * 4 + [1] * 8},
    {
        "tokens": [42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61],
        "loss_mask": [0] * 8 + [1] * 12,
    },
]
for record in RECORDS:
    record.update(advantages=1.0, logprobs=[0.0] * len(record["tokens"]))


def overrides(out_dir: str, seed: str) -> list[str]:
    return [
        "--job.dump_folder",
        os.path.join(out_dir, "run"),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        seed,
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "2",
        "--moe.aux_loss_coeff",
        "0",
        "--moe.z_loss_coeff",
        "0",
    ]


def api_worker(rank: int, port: int, out_dir: str, seed: str) -> None:
    from titan_fold.api import Trainer
    from titan_fold.checkpoint.files import read_hf_folder
    from titan_fold.checkpoint.trusted import CheckpointError

    trainer = Trainer.from_config("debug_moe.toml", overrides(out_dir, seed))
    got = trainer.logprobs(RECORDS)
    model = trainer.trainer.model_parts[0]
    for record, lp in zip(RECORDS, got, strict=True):
        tokens = torch.tensor(record["tokens"])
        with torch.no_grad():
            logits = model(tokens[None])[0]  # [s, vocab], the record alone, causal
        want = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, tokens[1:, None]).squeeze(-1)
        assert lp.shape == tokens.shape and lp[0] == 0
        torch.testing.assert_close(lp[1:], want, rtol=1e-5, atol=1e-5)

    before = {name: t.clone() for name, t in trainer.weights(dst=None)}
    metrics = trainer.train_step(RECORDS)
    trained = torch.cat(
        [lp[1:][torch.tensor(r["loss_mask"][1:], dtype=torch.bool)] for r, lp in zip(RECORDS, got, strict=True)]
    )
    assert metrics["step"] == 1
    assert metrics["loss"] == pytest.approx(-trained.mean().item(), rel=1e-5)
    after = {name: t.clone() for name, t in trainer.weights(dst=None)}
    assert after.keys() == before.keys()
    changed = [name for name in after if not torch.equal(after[name], before[name])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "lm_head.weight" in changed, changed

    trainer.save()
    trainer.close()
    resumed = Trainer.from_config("debug_moe.toml", overrides(out_dir, seed))
    assert resumed.step == 1
    for name, t in resumed.weights(dst=None):
        assert torch.equal(t, after[name]), name

    kept = os.path.join(out_dir, "kept")
    os.makedirs(kept)
    with open(os.path.join(kept, "notes.txt"), "w") as f:
        f.write("mine")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        resumed.save_hub(kept)
    assert os.listdir(kept) == ["notes.txt"]
    hub = os.path.join(out_dir, "hub")
    resumed.save_hub(hub)
    written = read_hf_folder(hub)
    assert written.keys() == after.keys()
    for name, t in written.items():
        assert torch.equal(t, after[name]), name
    with open(os.path.join(hub, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen2MoeForCausalLM"]
    resumed.close()


def test_api_at_one_rank(seed_checkpoint, tmp_path):
    run_ranks(api_worker, 1, tmp_path, seed_checkpoint)


def recorded_worker(rank: int, port: int, out_dir: str, seed: str) -> None:
    from titan_fold.api import Trainer
    from titan_fold.moe import moe_layers

    trainer = Trainer.from_config("debug_moe.toml", [*overrides(out_dir, seed), "--moe.routing_replay", "recorded"])
    trainer.logprobs(RECORDS)  # records each MoE layer's routing
    with torch.no_grad():
        for moe in moe_layers(trainer.trainer.model_parts):
            moe.router.gate.weight.neg_()  # every router now ranks the experts the other way round
    replayed = trainer.train_step(RECORDS)  # the logprobs pass's routing, not the routers' new choice
    fresh = trainer.train_step(RECORDS)  # no logprobs pass before it: the step records its own
    assert replayed["routing_replay_changed"] > 0.5, replayed
    assert fresh["routing_replay_changed"] == 0, fresh
    trainer.close()


def test_recorded_replay_takes_the_logprobs_pass_routing(seed_checkpoint, tmp_path):
    run_ranks(recorded_worker, 1, tmp_path, seed_checkpoint)
