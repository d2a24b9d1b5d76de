"""What a new user sees: the console of a run, its summary, TensorBoard, the plot, the seed,
and one-line errors.

Launches, shared by the tests: one 2-rank run (console, summary, TensorBoard, checkpoint),
three 1-process runs (the same command twice, and another seed), and one 2-rank launch with
a bad degree.
"""

import glob
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import python_m, read_metrics, torchrun

import titan_fold

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

STEPS = 6  # logged: 1, 5 (log_freq) and 6 (the last)
TEST_EXTRAS = ["transformers", "matplotlib", "pytest", "xdist"]  # pyproject.toml's [test] extra
NOISE = [
    "HF assets path",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "lspci",
    "Peak flops",
    "Peak FLOPS",
    "nan%",
    "safetensors.index.json",
    "UserWarning",
    "LOG_RANK",
    '"n_layers"',
    "Traceback",
    "[GC]",
    "purge thread",
    "staging if async",
    "Saving a ",
    "stdlib:",
    " on 1 ranks",
]
STEP_LINE = re.compile(
    r"step +(\d+)/(\d+)  loss +([\d.]+)  grad_norm +([\d.]+)  lr ([\d.e+-]+)  tps ([\d,]+)  mem ([\d.]+)GiB  "
    r"aux ([\d.]+)  drop ([\d.]+)  imbalance ([\d.]+)  elapsed (\d+:\d\d:\d\d)  eta (\d+:\d\d:\d\d)$"
)


def launch(nproc: int, *args: str, config: str = "debug_moe.toml", wait: bool = True, env: dict | None = None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "titan_fold.train",
        "--job.config_file",
        config,
        *args,
    ]
    env = dict(env or os.environ, OMP_NUM_THREADS="1")
    env.pop("LOG_RANK", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return finish(proc) if wait else proc


def finish(proc) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=900)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def messages(text: str) -> list[str]:
    """Log lines without the `[titan] date time - ` prefix (and `INFO - `)."""
    return [re.sub(r"^\[titan\] \S+ \S+ - (INFO - )?", "", line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("first_hour") / "run"
    result = launch(
        2,
        "--job.dump_folder",
        str(folder),
        "--training.steps",
        str(STEPS),
        "--metrics.enable_tensorboard",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "5",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return folder, result


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """Three 1-process runs, 2 steps each: the default seed twice, then --debug.seed 1. The
    second runs under torchrun as in a runtime install (the test extras cannot be imported)
    and gives the console checked below; the other two are forked (tests/launcher.py) while
    it runs, so the same losses must also come from another way of starting the process."""
    root = tmp_path_factory.mktemp("seed")
    for name in TEST_EXTRAS:
        (root / "no_extras" / name).mkdir(parents=True)
        (root / "no_extras" / name / "__init__.py").write_text(f"raise ModuleNotFoundError('{name} is a test extra')")
    runtime = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "no_extras"), os.environ.get("PYTHONPATH", "")]))
    proc = launch(1, "--job.dump_folder", str(root / "run1"), "--training.steps", "2", wait=False, env=runtime)
    for i, args in ((0, ()), (2, ("--debug.seed", "1"))):
        torchrun(1, "--job.dump_folder", str(root / f"run{i}"), "--training.steps", "2", *args)
    result = finish(proc)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [read_metrics(root / f"run{i}") for i in range(3)], result, root


def test_console_is_rank_zero_once_and_quiet(two_ranks):
    _, result = two_ranks
    lines = messages(result.stdout + result.stderr)
    # the same line twice = printed by both ranks (a save at steps 5 and 6 logs the same words)
    repeated = {line for line in lines if lines.count(line) > 1}
    assert not repeated, repeated
    assert not any(line.startswith("rank 1 - ") for line in lines), lines
    for noise in NOISE:
        assert not any(noise in line for line in lines), (noise, [line for line in lines if noise in line])
    assert "\x1b[" not in result.stdout  # no colour codes when stdout is not a terminal
    assert len(lines) < 40, "\n".join(lines)


def test_step_line_and_metrics_agree(two_ranks):
    folder, result = two_ranks
    records = {r["step"]: r for r in read_metrics(folder)}
    assert sorted(records) == [1, 5, STEPS]
    steps = [STEP_LINE.search(line) for line in messages(result.stdout)]
    steps = [m for m in steps if m]
    assert [int(m.group(1)) for m in steps] == [1, 5, STEPS]
    for m in steps:
        r = records[int(m.group(1))]
        assert int(m.group(2)) == STEPS
        assert float(m.group(3)) == pytest.approx(r["loss"], abs=1e-4)
        assert float(m.group(4)) == pytest.approx(r["grad_norm"], abs=1e-4)
        assert float(m.group(5)) == pytest.approx(r["lr"], rel=1e-2)
        assert float(m.group(10)) == pytest.approx(r["expert_load_imbalance"], abs=1e-2)
    assert steps[-1].group(12) == "0:00:00"  # nothing left at the last step


def test_summary(two_ranks):
    folder, result = two_ranks
    records = read_metrics(folder)
    text = "\n".join(messages(result.stdout))
    best = min(records, key=lambda r: r["loss"])
    assert f"run summary: steps 1-{STEPS} of {STEPS} in " in text, text
    assert f"-> {records[-1]['loss']:.4f} (step {STEPS}), best {best['loss']:.4f} (step {best['step']})" in text
    m = re.search(r"after warm-up \(steps 2-6\): ([\d,]+) tokens/s per device; peak memory ([\d.]+) GiB", text)
    assert m, text
    assert float(m.group(2)) == pytest.approx(max(r["max_memory_gib"] for r in records), abs=0.01)
    assert f"metrics: {folder / 'metrics.jsonl'}" in text
    assert f"tensorboard: {folder / 'tb'}" in text
    assert f"last checkpoint: {folder / 'checkpoint' / f'step-{STEPS}'} (weights only" in text
    saves = [line for line in messages(result.stdout) if line.startswith("checkpoint ")]
    assert [line.rsplit(" in ", 1)[0] for line in saves] == [
        f"checkpoint {folder / 'checkpoint' / 'step-5'} saved",
        f"checkpoint {folder / 'checkpoint' / f'step-{STEPS}'} (weights only, float32: checkpoint.last_save_model_only) saved",
    ]


def test_tensorboard_events_hold_the_losses(two_ranks):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, _ = two_ranks
    (events,) = glob.glob(str(folder / "tb" / "*" / "events.out.tfevents.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in read_metrics(folder)}, rel=1e-6)
    assert {"grad_norm", "lr", "tokens_per_sec", "expert_load_imbalance"} <= set(acc.Tags()["scalars"])
    assert "mfu" not in acc.Tags()["scalars"]  # null on the CPU


def test_default_seed_reproduces_the_run(seeded):
    """Also: the second run could not import the test extras (a runtime install trains)."""
    (a, b, other), _, _ = seeded
    assert a[0]["loss"] == b[0]["loss"] and a[1]["loss"] == b[1]["loss"], (a, b)
    assert other[0]["loss"] != a[0]["loss"]


def test_one_process_console(seeded):
    _, result, _ = seeded
    lines = messages(result.stdout + result.stderr)
    for noise in NOISE:
        assert not any(noise in line for line in lines), (noise, [line for line in lines if noise in line])
    assert any(line.startswith("step 2/2 ") for line in lines), lines


def test_plot_overlays_runs(two_ranks, seeded, tmp_path):
    import matplotlib.image
    import numpy as np

    folder, _ = two_ranks
    *_, seed_root = seeded
    out = tmp_path / "runs.png"
    result = python_m(
        "titan_fold.plot", str(folder), str(seed_root / "run0"), str(seed_root / "run2"), "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    image = matplotlib.image.imread(out)  # [h, w, rgba] in 0..1
    assert image.shape[0] >= 500 and image.shape[1] >= 800
    ink = (image[..., :3] < 0.9).any(-1).mean()
    colours = len(np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert 0.01 < ink < 0.5 and colours > 20, (ink, colours)


def test_plot_missing_run_is_one_line(tmp_path):
    result = python_m("titan_fold.plot", str(tmp_path / "nope"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "no metrics.jsonl" in result.stderr


@pytest.mark.parametrize(
    "command, args",
    [
        pytest.param("titan_fold.plot", ["RUN"], id="plot"),
        pytest.param(
            "titan_fold.layout", ["--world-size", "4", "--ep", "2", "--format", "png", "--out", "OUT"], id="layout"
        ),
    ],
)
def test_png_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys, command, args):
    """README's install leaves out the plot extra: both commands that draw say so in one line,
    before any work (nothing written), with how to install it."""
    import importlib

    from titan_fold.common.errors import run_command

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"run": "a", "step": 1, "loss": 1.0}) + "\n")
    args = [str(tmp_path / "run") if a == "RUN" else str(tmp_path / "l.png") if a == "OUT" else a for a in args]
    module = importlib.import_module(command)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError
    with pytest.raises(SystemExit) as exit:
        run_command(lambda: module.main(args))
    what = "python -m titan_fold.plot" if command == "titan_fold.plot" else "python -m titan_fold.layout --format png"
    assert exit.value.code == 2
    assert capsys.readouterr().err == f'error: {what} needs matplotlib: pip install -e ".[plot]"\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_bad_degree_under_torchrun_is_one_line(tmp_path):
    result = launch(2, "--job.dump_folder", str(tmp_path / "run"), "--parallelism.expert_parallel_degree", "3")
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1, result.stderr
    assert ours[0].startswith("error: --parallelism.expert_parallel_degree 3, "), ours
    assert "ep(3) * etp(1) = 3 must divide world_size / pp = 2 / 1 = 2" in ours[0]
    # torchrun's own failure summary follows; its root cause is the same line, no worker traceback
    package = os.path.dirname(titan_fold.__file__) + os.sep  # a worker traceback names its files
    assert package not in result.stderr and package not in result.stdout
    assert "traceback : LayoutError: --parallelism.expert_parallel_degree 3" in result.stderr
    assert not (tmp_path / "run").exists()  # nothing written before the check


def test_user_error_reported_once_per_launch(tmp_path, monkeypatch, capsys):
    """Every rank fails the same check; the first to get there prints, all fill their error file."""
    from titan_fold.common.errors import UserError, run_command

    def main():
        raise UserError("--training.steps -1: must be >= 0")

    for local_rank in range(3):
        (tmp_path / str(local_rank)).mkdir()
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / str(local_rank) / "error.json"))
        monkeypatch.setenv("RANK", str(2 - local_rank))
        with pytest.raises(SystemExit) as exit:
            run_command(main)
        assert exit.value.code == 2
        data = json.load(open(tmp_path / str(local_rank) / "error.json"))
        assert data["message"]["extraInfo"]["py_callstack"] == "UserError: --training.steps -1: must be >= 0"
    assert capsys.readouterr().err == "error: --training.steps -1: must be >= 0\n"


@pytest.mark.parametrize("rank, log_rank, shown", [(0, None, "iw"), (1, None, "w"), (1, "all", "iw"), (1, "0,1", "iw")])
def test_logging_rank_rule_and_noise(rank, log_rank, shown, monkeypatch, capsys):
    import logging

    from torchtitan.tools.logging import logger

    from titan_fold.trainer.logs import setup_logging

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    if log_rank is None:
        monkeypatch.delenv("LOG_RANK", raising=False)
    else:
        monkeypatch.setenv("LOG_RANK", log_rank)
    handlers = list(logger.handlers)
    try:
        setup_logging("cpu")
        logger.info("an info line")
        logger.warning("a warning")
        logger.warning("HF assets path ./tests/assets/tokenizer does not exist!")  # torchtitan's default: noise
        logger.warning("HF assets path /data/mine does not exist!")  # a path the user gave: shown
        logger.info("Peak flops undefined for: cpu, fallback to A100")
    finally:
        logger.handlers[:] = handlers
        logging.captureWarnings(False)
    out = messages(capsys.readouterr().out)
    who = f"rank {rank} - " if rank else ""
    expected = ([f"{who}INFO - an info line" if rank else "an info line"] if "i" in shown else []) + [
        f"{who}WARNING - a warning",
        f"{who}WARNING - HF assets path /data/mine does not exist!",
    ]
    assert out == expected
