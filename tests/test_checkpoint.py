"""Checkpoints: exact resume, resume under another folding, faults, and loading safely.

The trainer runs share one seed checkpoint, aux-free routing (so the router biases are
state that must come back), micro-batches of one sequence (aux statistics then see the
same tokens in every layout) and fp32 on CPU:

    A  = 2 ranks, attention dp 2, experts ep 2          uninterrupted, saves step 3
    R1 = 1 rank                                         uninterrupted, saves step 3
    to_one:  A's step 3 -> 1 rank           (ep 2 -> 1, dp 2 -> 1, world 2 -> 1) vs R1
    to_cp:   A's step 3 -> 2 ranks, attention cp 2, experts etp 2 (dp 2 -> 1, cp 1 -> 2,
             ep 2 -> 1, etp 1 -> 2) vs R1
    to_four: R1's step 3 -> 4 ranks, attention tp 2 x dp 2, experts ep 2 x etp 2
             (tp 1 -> 2, dp 1 -> 2, ep 1 -> 2, etp 1 -> 2, world 1 -> 4) vs R1
    to_pp:   A's step 3 -> 4 ranks, pp 2 with attention dp 2 and experts edp 2 per stage
             (pp 1 -> 2, ep 2 -> 1, edp 1 -> 2: expert weights and Adam moments move from
             ep shards to FSDP shards; world 2 -> 4; each stage loads only its layers) vs R1
    fault:   A with rank 1 SIGKILLed in step 5 under torchrun: the restart resumes from
             step 3 on the same layout, and steps 4..6 equal A's bit for bit (this is
             also the exact-resume test: stopped at step 5, resumed from step 3)

R1 is the reference at every layout: folded layouts equal the one-rank run up to float
rounding (tests/test_equivalence.py; here checked again between A and R1 at 1e-5).
"""

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import checkpointed_run, forked, read_metrics, router_biases, torchrun
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from titan_fold.checkpoint.files import validate_against
from titan_fold.checkpoint.manager import SETTINGS_FILE, CheckpointError, complete
from titan_fold.checkpoint.settings import check_resume, run_settings
from titan_fold.checkpoint.trusted import read_metadata

STEPS = 6
COMMON = checkpointed_run(STEPS)
EP2 = ("--parallelism.expert_parallel_degree", "2")


def losses(folder) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder)}


def run(folder, nproc, *args, seed=None):
    extra = ("--checkpoint.initial_load_path", seed) if seed else ()
    torchrun(nproc, "--job.dump_folder", str(folder), *COMMON, *extra, *args)
    return losses(folder)


def resume(folder, checkpoint, nproc, *args):
    """A new run folder whose checkpoint/ holds only `checkpoint` (a step-N folder)."""
    os.makedirs(folder / "checkpoint")
    shutil.copytree(checkpoint, folder / "checkpoint" / os.path.basename(checkpoint))
    return run(folder, nproc, *args)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, seed_checkpoint):
    folder = tmp_path_factory.mktemp("a")
    return folder, run(folder, 2, *EP2, seed=seed_checkpoint)


@pytest.fixture(scope="module")
def run_one(tmp_path_factory, seed_checkpoint):
    folder = tmp_path_factory.mktemp("one")
    return folder, run(folder, 1, seed=seed_checkpoint)


def close(got: dict, ref: dict, steps, rel=1e-5):
    for s in steps:
        assert got[s] == pytest.approx(ref[s], rel=rel), (s, got[s], ref[s])


def same_biases(resumed, ref) -> None:
    """The resumed run's biases at the last step equal the uninterrupted one-rank run's: each
    update is a sign step of the rate (1e-3) from the expert loads, so a lost or stale bias is a
    step or more off, exactly, where the losses it moves stay within a few times their
    tolerance (the biases are 3e-3 at most when step 3 is saved)."""
    got, want = (router_biases(f / "checkpoint" / f"step-{STEPS}") for f in (resumed, ref))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, got[k], want[k])


@pytest.mark.slow
def test_checkpoint_holds_every_state(run_a):
    folder, _ = run_a
    step3 = str(folder / "checkpoint" / "step-3")
    md = read_metadata(step3).state_dict_metadata
    # experts' Adam moments: one global [E, 2 * ffn, dim] tensor, written by the ep shards
    exp_avg = md["optimizer.state.layers.0.moe.experts.w13.exp_avg"]
    assert isinstance(exp_avg, TensorStorageMetadata) and list(exp_avg.size) == [8, 64, 64]
    assert len(exp_avg.chunks) == 2  # one chunk per ep rank
    for key in ("lr_scheduler.last_epoch", "dataloader.consumed_sequences", "train_state.step"):
        assert isinstance(md[key], BytesStorageMetadata), key
    assert isinstance(md["rng.cpu"], TensorStorageMetadata)
    assert "layers.0.moe.router.expert_bias" in md, "the aux-free router bias is not in the checkpoint"
    import torch.distributed.checkpoint as dcp

    assert "layers.0.moe.router.expert_bias" in md  # the aux-free bias is state (a resume needs it)
    state = {
        "layers.0.moe.router.expert_bias": torch.zeros(8),
        "train_state": {"step": 0},
        "lr_scheduler": {"last_epoch": 0},
        "dataloader": {"consumed_sequences": 0},
    }
    dcp.load(state, checkpoint_id=step3)
    assert state["train_state"]["step"] == 3
    assert state["lr_scheduler"]["last_epoch"] == 3
    assert state["dataloader"]["consumed_sequences"] == 3 * 8  # global position, not per rank
    assert state["layers.0.moe.router.expert_bias"].abs().sum() > 0  # aux-free biases moved


@pytest.mark.slow
def test_layouts_agree_uninterrupted(run_a, run_one):
    close(run_a[1], run_one[1], range(1, STEPS + 1))


@pytest.mark.slow
def test_resume_two_ranks_ep2_on_one_rank(run_a, run_one, tmp_path):
    got = resume(tmp_path, run_a[0] / "checkpoint" / "step-3", 1)
    same_biases(tmp_path, run_one[0])  # exact: before the losses, which a lost bias moves by little
    close(got, run_one[1], (4, 5, 6))


@pytest.mark.slow
def test_resume_two_ranks_ep2_on_pipeline_pp2_edp2(run_a, run_one, tmp_path):
    # 4 pipeline micro-batches of one sequence per rank and step
    got = resume(
        tmp_path,
        run_a[0] / "checkpoint" / "step-3",
        4,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.local_batch_size",
        "4",
    )
    same_biases(tmp_path, run_one[0])  # exact: before the losses, which a lost bias moves by little
    close(got, run_one[1], (4, 5, 6))


@pytest.mark.slow
def test_resume_one_rank_on_four_ranks_tp2_ep2_etp2(run_one, tmp_path):
    got = resume(
        tmp_path,
        run_one[0] / "checkpoint" / "step-3",
        4,
        *EP2,
        "--parallelism.expert_tensor_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    )
    same_biases(tmp_path, run_one[0])  # exact: before the losses, which a lost bias moves by little
    close(got, run_one[1], (4, 5, 6))


@pytest.mark.slow
def test_resume_two_ranks_dp2_ep2_on_cp2_etp2(run_a, run_one, tmp_path):
    got = resume(
        tmp_path,
        run_a[0] / "checkpoint" / "step-3",
        2,
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.expert_tensor_parallel_degree",
        "2",
    )
    same_biases(tmp_path, run_one[0])  # exact: before the losses, which a lost bias moves by little
    close(got, run_one[1], (4, 5, 6))


@pytest.mark.slow
def test_killed_rank_restarts_from_last_complete_checkpoint(run_a, seed_checkpoint, tmp_path):
    """Rank 1 dies (SIGKILL) inside step 5 under torchrun --max-restarts.

    The run folder starts with the seed as checkpoint/step-0 (torchtitan loads step 0 model
    only) and a half-written step-5 folder (data, no .metadata: what a kill during a save
    leaves). Neither attempt may take step-5; the restart resumes from step-3, and steps
    4..6 equal the uninterrupted run A: nothing lost, nothing seen twice.
    """
    _, ref = run_a
    shutil.copytree(seed_checkpoint, tmp_path / "checkpoint" / "step-0")
    partial = tmp_path / "checkpoint" / "step-5"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half written")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "-m",
        "titan_fold.train",
        "--job.config_file",
        "debug_moe.toml",
        "--job.dump_folder",
        str(tmp_path),
        *COMMON,
        *EP2,
    ]
    # torch 2.13's torchrun shares one TCPStore across restarts: the restarted ranks can read
    # the dead attempt's gloo addresses from it and hang in init_process_group. A fresh
    # store per attempt (rank 0 hosts it) avoids that.
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        TITAN_FOLD_FAULT_AT_STEP="5",
        TITAN_FOLD_FAULT_RANK="1",
    )
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert "fault injection: SIGKILL to rank 1 in step 5" in log, log[-3000:]  # rank 1 died of SIGKILL
    loads = [
        line.split("Loading the checkpoint from ")[1].strip(" .")
        for line in log.splitlines()
        if "Loading the checkpoint from" in line
    ]
    assert {os.path.basename(p) for p in loads} == {"step-0", "step-3"}, loads
    steps = [r["step"] for r in read_metrics(tmp_path)]
    # first attempt: steps 1..4 (step 5 never finished); the restart from step 3 drops the
    # first attempt's record of step 4 and writes 4..6: each step once (metrics_file.py)
    assert steps == [1, 2, 3, 4, 5, 6], steps
    assert len({r["run"] for r in read_metrics(tmp_path)}) == 2
    got = losses(tmp_path)
    for s in range(1, STEPS + 1):
        assert got[s] == ref[s], (s, got[s], ref[s])
    assert complete(str(tmp_path / "checkpoint" / "step-6")) and not complete(str(partial))


# ---------------------------------------------------------------- no launch


@pytest.mark.slow
def test_find_load_step_skips_incomplete(seed_checkpoint, tmp_path):
    from torchtitan.components.checkpoint import CheckpointManager

    for step in (3, 7):
        shutil.copytree(seed_checkpoint, tmp_path / f"step-{step}")
    os.remove(tmp_path / "step-7" / ".metadata")  # killed before DCP's last write

    class Probe:
        folder = str(tmp_path)

    assert CheckpointManager._find_load_step(Probe()) == 3
    assert complete(str(tmp_path / "step-3")) and not complete(str(tmp_path / "step-7"))


@pytest.mark.slow
def test_mismatched_checkpoint_fails_clearly(seed_checkpoint):
    md = read_metadata(seed_checkpoint).state_dict_metadata
    good = {k: torch.empty(m.size) for k, m in md.items() if isinstance(m, TensorStorageMetadata)}
    validate_against(seed_checkpoint, good)  # fits
    wrong_vocab = dict(good, **{"tok_embeddings.weight": torch.empty(1000, 64)})
    with pytest.raises(
        CheckpointError, match=r"tok_embeddings.weight: checkpoint \[512, 64\], model \[1000, 64\][\s\S]*vocabulary"
    ):
        validate_against(seed_checkpoint, wrong_vocab)
    other_model = dict(good, **{"layers.9.attention.wq.weight": torch.empty(64, 64)})
    with pytest.raises(CheckpointError, match="missing from the checkpoint.*layers.9.attention.wq.weight"):
        validate_against(seed_checkpoint, other_model)


def test_checkpoint_with_gate_and_up_apart_names_the_way_out(tmp_path):
    """A checkpoint whose routed experts hold w1 and w3 apart (titan_fold before experts.w13):
    refused before any read, naming the conversion through a Hugging Face folder."""
    import torch.distributed.checkpoint as dcp

    old = {
        "layers.0.moe.experts.w1": torch.randn(4, 8, 16),
        "layers.0.moe.experts.w3": torch.randn(4, 8, 16),
        "layers.0.moe.experts.w2": torch.randn(4, 16, 8),
    }
    dcp.save(old, checkpoint_id=str(tmp_path / "step-1"))
    want = {"layers.0.moe.experts.w13": torch.empty(4, 16, 16), "layers.0.moe.experts.w2": torch.empty(4, 16, 8)}
    with pytest.raises(
        CheckpointError,
        match=r"missing from the checkpoint \(1\): layers.0.moe.experts.w13\n"
        r"[\s\S]*experts.w1 / w3[\s\S]*python -m titan_fold.hf export",
    ):
        validate_against(str(tmp_path / "step-1"), want)


@pytest.mark.slow
def test_truncated_data_file_fails_before_loading(seed_checkpoint, tmp_path):
    bad = tmp_path / "step-0"
    shutil.copytree(seed_checkpoint, bad)
    data = next(p for p in bad.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:1000])
    md = read_metadata(str(bad)).state_dict_metadata
    want = {k: torch.empty(m.size) for k, m in md.items() if isinstance(m, TensorStorageMetadata)}
    with pytest.raises(CheckpointError, match="truncated"):
        validate_against(str(bad), want)
    data.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        validate_against(str(bad), want)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.slow
def test_metadata_is_unpickled_with_an_allow_list(seed_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(seed_checkpoint, bad)
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="refusing to unpickle (posix|os).system"):
        read_metadata(str(bad))
    # a name the allowed module merely imports (metadata.py imports os) is refused too
    module, name = b"torch.distributed.checkpoint.metadata", b"os.system"
    sneaky = b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93."
    (bad / ".metadata").write_bytes(sneaky)
    with pytest.raises(CheckpointError, match="refusing to unpickle torch.distributed.checkpoint.metadata.os.system"):
        read_metadata(str(bad))
    (bad / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match="unreadable DCP metadata"):
        read_metadata(str(bad))


def test_non_tensor_entries_must_load_weights_only(tmp_path):
    """DCP stores non-tensor values with torch.save and reads them with weights_only=False:
    such an entry holding a callable is refused before DCP reads anything."""
    import torch.distributed.checkpoint as dcp

    from titan_fold.checkpoint.trusted import check_bytes_entries

    dcp.save({"w": torch.zeros(2), "train_state": {"step": 3}}, checkpoint_id=str(tmp_path / "ok"))
    check_bytes_entries(str(tmp_path / "ok"), read_metadata(str(tmp_path / "ok")))
    dcp.save({"w": torch.zeros(2), "train_state": {"step": _Evil()}}, checkpoint_id=str(tmp_path / "bad"))
    with pytest.raises(CheckpointError, match="train_state.step"):
        check_bytes_entries(str(tmp_path / "bad"), read_metadata(str(tmp_path / "bad")))


@pytest.mark.slow
def test_checkpoint_records_the_runs_settings(run_a):
    folder, _ = run_a
    with open(folder / "checkpoint" / "step-3" / SETTINGS_FILE) as f:
        saved = json.load(f)
    assert saved["training.seq_len"] == 128 and saved["training.global_batch_size"] == 8
    assert (saved["model.name"], saved["model.flavor"], saved["tokenizer"]) == (
        "qwen2_moe",
        "debug",
        "byte-level, 258 tokens",
    )
    assert saved["training.steps"] == STEPS and saved["optimizer.lr"] == 3e-3


@pytest.mark.slow
def test_resume_with_another_seq_len_is_one_line_before_any_work(run_a, tmp_path):
    os.makedirs(tmp_path / "checkpoint")
    shutil.copytree(run_a[0] / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")
    codes, out, err = forked(
        2,
        "titan_fold.train",
        "--job.config_file",
        "debug_moe.toml",
        "--job.dump_folder",
        str(tmp_path),
        *COMMON,
        "--training.seq_len",
        "256",
    )
    assert codes[0] == 2, (codes, out[-2000:], err[-3000:])
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert lines == [
        f"error: training.seq_len = 256, but {tmp_path}/checkpoint/step-3 was saved with training.seq_len "
        f"= 128: a resume keeps it (to start from these weights with new settings: another "
        f"job.dump_folder and --checkpoint.initial_load_path {tmp_path}/checkpoint/step-3)"
    ], lines
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]  # nothing written, the lock not taken


@pytest.mark.slow
def test_resume_names_what_changes_and_keeps_layout_changes_silent(run_a, tmp_path):
    from titan_fold.common.config import parse_args
    from titan_fold.data import build_tokenizer

    os.makedirs(tmp_path / "checkpoint")
    shutil.copytree(run_a[0] / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")

    def check(*args, dp=2):
        config = parse_args(["--job.config_file", "debug_moe.toml", "--job.dump_folder", str(tmp_path), *COMMON, *args])
        return check_resume(config, run_settings(config, build_tokenizer(config), dp))

    assert check(*EP2, "--parallelism.context_parallel_degree", "2", dp=1) == []  # another layout: resharding
    assert check("--training.global_batch_size", "16", "--lr_scheduler.warmup_steps", "2") == [
        f"resuming {tmp_path}/checkpoint/step-3 with training.global_batch_size = 16 (saved with 8): the run continues "
        f"with the new value",
        f"resuming {tmp_path}/checkpoint/step-3 with lr_scheduler.warmup_steps = 2 (saved with 5): the run continues "
        f"with the new value",
    ]
    with pytest.raises(
        CheckpointError, match=r"^model.flavor = '57B-A14B', but .* was saved with model.flavor = 'debug'"
    ):
        check("--model.flavor", "57B-A14B")
    assert check("--optimizer.name", "Adam") == []  # Adam's states are AdamW's
    with pytest.raises(
        CheckpointError,
        match=r"^optimizer.name = 'Muon', but .* was saved with optimizer.name = "
        r"'AdamW': their states differ [^\n]*$",
    ):
        check("--optimizer.name", "Muon")
    os.remove(tmp_path / "checkpoint" / "step-3" / SETTINGS_FILE)  # saved before settings were recorded
    assert check("--training.seq_len", "256") == []


# ---------------------------------------------------------------- extending a finished run

# the lr schedule of `--training.steps 4` with one warm-up step: 1, 1, 2/3, 1/3 of the lr; of
# `--training.steps 2`: 1, 1, then 0 (decayed to zero at its end)
EXTEND = (
    "--training.local_batch_size",
    "1",
    "--training.global_batch_size",
    "2",
    "--training.seq_len",
    "32",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.log_freq",
    "1",
)


def records(folder) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(folder)}


def train(folder, *args) -> tuple[list[int], str]:
    """One rank; -> exit codes and stdout + stderr."""
    codes, out, err = forked(
        1, "titan_fold.train", "--job.config_file", "debug_moe.toml", "--job.dump_folder", str(folder), *EXTEND, *args
    )
    return codes, out + err


def folder_bytes(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """The reference: 4 steps in one run."""
    folder = tmp_path_factory.mktemp("four")
    codes, log = train(folder, "--training.steps", "4")
    assert codes == [0], log[-4000:]
    return records(folder)


@pytest.mark.slow
def test_extending_a_run_with_the_defaults_resumes_its_model_only_checkpoint(four_steps, tmp_path):
    """`--checkpoint.enable --training.steps 2`, then the same with 4: the last save of the first
    run holds the weights only (checkpoint.last_save_model_only, the default). The second run
    loads them, says so in one line, and goes on at step 3 with the data where the first run
    stopped, the lr of the 4-step schedule and a fresh optimizer state: its first loss is the
    4-step run's (same weights, same batch), its first lr too; step-2 is left as it was."""
    codes, log = train(tmp_path, "--checkpoint.enable", "--training.steps", "2")
    assert codes == [0], log[-4000:]
    step2 = tmp_path / "checkpoint" / "step-2"
    saved = folder_bytes(step2)
    codes, log = train(tmp_path, "--checkpoint.enable", "--training.steps", "4")
    assert codes == [0], log[-4000:]
    said = [line for line in log.splitlines() if "weights only" in line and "resum" in line]
    assert len(said) == 1 and str(step2) in said[0] and "optimizer" in said[0], log[-4000:]
    got = records(tmp_path)
    assert sorted(got) == [1, 2, 3, 4]
    for key in ("loss", "lr", "n_tokens_seen"):
        assert got[3][key] == four_steps[3][key], (key, got[3][key], four_steps[3][key])
    assert folder_bytes(step2) == saved  # nothing saved is lost or overwritten
    assert complete(str(tmp_path / "checkpoint" / "step-4"))


@pytest.mark.slow
def test_a_resumed_run_takes_the_new_lr_schedule_from_its_first_step(four_steps, tmp_path):
    """Full checkpoints: 2 steps extended to 4 are the 4-step run bit for bit (the first run's
    schedule would give step 3 an lr of 0); resumed with another optimizer.lr, step 3 runs
    with the new lr on the 4-step schedule."""
    full = ("--checkpoint.enable", "--checkpoint.no-last_save_model_only")
    codes, log = train(tmp_path / "a", *full, "--training.steps", "2")
    assert codes == [0], log[-4000:]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    codes, log = train(tmp_path / "a", *full, "--training.steps", "4")
    assert codes == [0], log[-4000:]
    got = records(tmp_path / "a")
    for step in (3, 4):
        assert (got[step]["lr"], got[step]["loss"]) == (four_steps[step]["lr"], four_steps[step]["loss"]), step
    codes, log = train(tmp_path / "b", *full, "--training.steps", "4", "--optimizer.lr", "1e-3")
    assert codes == [0], log[-4000:]
    got = records(tmp_path / "b")
    assert got[3]["lr"] == pytest.approx(four_steps[3]["lr"] / 3, rel=1e-12)  # 3e-3 -> 1e-3
