"""Rollout data (training.dataset_format = "rollouts"): packing keeps every per-token field
beside its token, the binary routed_experts form reads as the list form, and each kind of
malformed record is refused in one line naming the file and the record, before training."""

import base64
import json
import re

import numpy as np
import pytest
import torch
from helpers import python_m

from titan_fold.common.config import ConfigError, parse_args
from titan_fold.data.dataloader import ROLLOUTS_EXAMPLE, build_dataset, check_dataset
from titan_fold.data.dataset import DataError
from titan_fold.data.rollouts import ROUTED_EXPERTS_KEY, encode_routed_experts
from titan_fold.models.mtp import IGNORE_INDEX
from titan_fold.trainer.preflight import model_args_from_config

ROLLOUTS = ["--training.dataset_format", "rollouts", "--training.seq_len", "256"]
EXAMPLE = ["--training.dataset", "rollouts_example"]


def job(tmp_path, *overrides, path=None):
    where = ["--training.dataset", "hf", "--training.dataset_path", str(path)] if path else []
    where = where or EXAMPLE
    return parse_args(
        [
            "--job.config_file",
            "debug_moe.toml",
            "--job.dump_folder",
            str(tmp_path / "run"),
            *ROLLOUTS,
            *where,
            *overrides,
        ]
    )


def model_args(config):
    return model_args_from_config(config)[1]


def record(n_prompt: int, n_response: int, seed: int) -> dict:
    """A valid record for the debug model (8 experts, top-2, 4 MoE layers)."""
    rng = np.random.default_rng(seed)
    n = n_prompt + n_response
    routed = np.stack([[rng.choice(8, 2, replace=False) for _ in range(4)] for _ in range(n)])
    return {
        "tokens": rng.integers(0, 258, n).tolist(),
        "loss_mask": [0] * n_prompt + [1] * n_response,
        "advantages": float(rng.normal()),
        "logprobs": (-rng.gamma(1.0, 1.0, n)).round(4).tolist(),
        "routed_experts": routed.tolist(),
    }


def write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_fields_follow_their_tokens_through_packing(tmp_path):
    records = [record(5, 7, seed) for seed in range(6)]
    records[2]["advantages"] = np.linspace(-1, 1, 12).round(4).tolist()  # one per token
    records[3]["routed_experts"] = encode_routed_experts(np.asarray(records[3]["routed_experts"]))
    path = write(tmp_path / "r.jsonl", records)
    config = job(tmp_path, path=path)
    ds = build_dataset(None, config, model_args(config))
    assert len(ds.packs) == 1 and len(ds.packs[0]) == 6
    x, labels = ds[0]
    start = 0
    for i, r in enumerate(records):
        n = len(r["tokens"])
        span = slice(start, start + n)
        assert x["input"][span].tolist() == r["tokens"]
        assert (x["document_ids"][span] == i).all()
        # label i is token i + 1 where its loss_mask is 1; its log-prob and advantage are that token's
        want = [t if m else IGNORE_INDEX for t, m in zip(r["tokens"][1:], r["loss_mask"][1:], strict=True)]
        assert labels[start : start + n - 1].tolist() == want and labels[start + n - 1] == IGNORE_INDEX
        adv = r["advantages"] if isinstance(r["advantages"], list) else [r["advantages"]] * n
        torch.testing.assert_close(x["behaviour_logprobs"][start : start + n - 1], torch.tensor(r["logprobs"][1:]))
        torch.testing.assert_close(x["advantages"][start : start + n - 1], torch.tensor(adv[1:]))
        routed = r["routed_experts"]
        if isinstance(routed, str):  # read here as the layout says: little-endian int16 [n, 4, 2]
            routed = np.frombuffer(base64.b64decode(routed), "<i2").reshape(n, 4, 2).tolist()
        assert x[ROUTED_EXPERTS_KEY][span].tolist() == routed  # the routing of each input token
        start += n
    # padding: no labels, no replayed routing (-1: the router's own choice)
    assert (labels[start:] == IGNORE_INDEX).all()
    assert (x[ROUTED_EXPERTS_KEY][start:] == -1).all()
    assert x[ROUTED_EXPERTS_KEY].dtype == torch.int64 and x[ROUTED_EXPERTS_KEY].shape == (256, 4, 2)


def test_binary_form_reads_as_the_list_form(tmp_path):
    lists = [record(3, 9, seed) for seed in range(3)]
    binary = [dict(r, routed_experts=encode_routed_experts(np.asarray(r["routed_experts"]))) for r in lists]
    got = []
    for name, records in (("lists", lists), ("binary", binary)):
        config = job(tmp_path, path=write(tmp_path / f"{name}.jsonl", records))
        got.append(build_dataset(None, config, model_args(config))[0][0][ROUTED_EXPERTS_KEY])
    assert torch.equal(got[0], got[1]) and got[0][:12].tolist() == lists[0]["routed_experts"]


def test_without_routed_experts_the_batch_has_no_such_key(tmp_path):
    records = [{k: v for k, v in record(4, 4, seed).items() if k != "routed_experts"} for seed in range(2)]
    config = job(tmp_path, path=write(tmp_path / "r.jsonl", records))
    assert ROUTED_EXPERTS_KEY not in build_dataset(None, config, model_args(config))[0][0]


def test_the_example_suits_the_debug_flavors(tmp_path):
    """Every record routed, in both forms, for every debug flavor with 4 MoE layers of 8 experts, top-2."""
    with open(ROLLOUTS_EXAMPLE) as f:
        forms = {type(json.loads(line)["routed_experts"]).__name__ for line in f}
    assert forms == {"list", "str"}
    for name in ("qwen2_moe", "qwen3_moe", "mixtral"):
        config = parse_args(["--job.config_file", "debug_moe.toml", "--model.name", name, *ROLLOUTS, *EXAMPLE])
        ds = build_dataset(None, config, model_args(config))
        assert ROUTED_EXPERTS_KEY in ds[0][0] and ds.trained_tokens > 0


def _routed(r, fn):
    """r with routed_experts changed by fn (on a nested list copy)."""
    routed = json.loads(json.dumps(r["routed_experts"]))
    fn(routed)
    return dict(r, routed_experts=routed)


def _binary(r, layers):
    """r with routed_experts in the binary form, holding `layers` MoE layers per token."""
    n = len(r["tokens"])
    return dict(r, routed_experts=encode_routed_experts(np.tile(np.arange(2), (n, layers, 1))))


GOOD = record(4, 6, 100)
N = len(GOOD["tokens"])


def bad_cases():
    """(record, what the line says after the record's place); a few made from random draws in the body."""
    rng = np.random.default_rng()
    t, layer = int(rng.integers(0, N)), int(rng.integers(0, 4))
    expert = int(rng.integers(8, 1000))
    cases = [
        (dict(GOOD, logprobs=GOOD["logprobs"][:-1]), rf"'logprobs' has {N - 1} values but 'tokens' has {N}"),
        (dict(GOOD, loss_mask=GOOD["loss_mask"] + [1]), rf"'loss_mask' has {N + 1} values but 'tokens' has {N}"),
        (dict(GOOD, advantages=[0.5] * (N + 2)), rf"'advantages' has {N + 2} values but 'tokens' has {N}"),
        (_routed(GOOD, lambda r: r.pop()), rf"'routed_experts' has {N - 1} tokens but 'tokens' has {N}"),
        (
            _routed(GOOD, lambda r: r[t][layer].__setitem__(1, expert)),
            rf"'routed_experts' of token {t}, MoE layer {layer}: expert {expert} is out of range",
        ),
        (
            _routed(GOOD, lambda r: r[t][layer].__setitem__(1, r[t][layer][0])),
            rf"'routed_experts' of token {t}, MoE layer {layer} repeats an expert",
        ),
        (
            _routed(GOOD, lambda r: r[t].append([0, 1])),
            rf"'routed_experts' of token {t} has 5 MoE layers, the model has 4",
        ),
        (
            _routed(GOOD, lambda r: r[t][layer].append(7 if 7 not in r[t][layer] else 6)),
            rf"'routed_experts' of token {t}, MoE layer {layer} has 3 ids, the model's top_k is 2",
        ),
        (
            _binary(GOOD, 3),
            r"'routed_experts' \(base64 int16\) holds \d+ ids: 6 ids per token \(3 MoE layers of top_k 2\), but the model has 4",
        ),
        (dict(GOOD, reward=1.0), r"unknown keys \['reward'\]"),
        ({k: v for k, v in GOOD.items() if k != "advantages"}, r"no \['advantages'\]"),
        (dict(GOOD, tokens=[*GOOD["tokens"][:-1], 512]), rf"token {N - 1} is id 512, outside the model's vocabulary"),
        ({k: v for k, v in GOOD.items() if k != "routed_experts"}, r"no 'routed_experts', but record 0 has"),
    ]
    return cases


def refusal(read, *args) -> str | None:
    """The DataError line read(*args) raises, or None when it reads the file."""
    try:
        read(*args)
    except DataError as e:
        return str(e)
    return None


def test_each_malformed_record_is_refused_in_one_line(tmp_path):
    for i, (bad, message) in enumerate(bad_cases()):
        path = write(tmp_path / f"bad{i}.jsonl", [GOOD, GOOD, bad, GOOD])
        config = job(tmp_path, path=path)
        want = rf"training.dataset_path = '{path}': record 2 \(line 3\): {message}"
        args = model_args(config)
        # the preflight's check, and the run's own reading had the check been skipped
        for line in (refusal(check_dataset, config, None, args), refusal(build_dataset, None, config, args)):
            assert line is not None and re.match(want, line) and "\n" not in line, (message, line)


@pytest.mark.slow
def test_dry_run_refuses_a_malformed_file_and_takes_the_keys(tmp_path):
    """The dry run's preflight reads the file against the model as a real run does."""
    bad = write(tmp_path / "bad.jsonl", [GOOD, _routed(GOOD, lambda r: r[0][0].__setitem__(0, 9))])
    args = ["--job.config_file", "debug_moe.toml", "--comm.mode", "fake_backend", "--comm.dry_run_collectives"]
    args += ["false", "--job.dump_folder", str(tmp_path / "dry"), *ROLLOUTS, "--training.objective", "policy"]
    args += ["--training.policy_tis_cap", "2"]
    env = {"NGPU": "2"}
    path = ["--training.dataset", "hf", "--training.dataset_path", str(bad)]
    refused = python_m("titan_fold.train", *args, *path, env=env)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"'{bad}': record 1 (line 2): 'routed_experts' of token 0, MoE layer 0: expert 9" in refused.stderr
    ok = python_m("titan_fold.train", *args, *EXAMPLE, env=env)
    assert ok.returncode == 0, ok.stderr[-3000:]


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(
            ["--training.objective", "policy"],
            "training.objective = 'policy' with training.dataset_format = 'text'",
            id="policy_needs_rollouts",
        ),
        pytest.param(["--training.kl_coef", "0.1"], "--training.kl_coef: .* needs no reference model", id="kl_coef"),
        pytest.param(
            ["--training.kl_to_reference", "true"], "--training.kl_to_reference: .* no KL-to-reference", id="kl_ref"
        ),
        pytest.param(["--training.policy_tis_cap", "0.5"], "training.policy_tis_cap = 0.5: must be >= 1", id="tis"),
    ],
)
def test_policy_settings_refused_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--job.config_file", "debug_moe.toml", *args])


def test_kl_key_in_a_config_file_refused(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text('[model]\nname = "qwen2_moe"\nflavor = "debug"\n[training]\nuse_kl_loss = true\n')
    with pytest.raises(ConfigError, match=r"^training.use_kl_loss: .* needs no reference model"):
        parse_args(["--job.config_file", str(toml)])
