"""The dry run's cost on this machine's CPU: `NGPU=N python -m titan_fold.train --job.config_file
CONFIG --comm.mode fake_backend` as README shows it, with and without the collective check.

    python bench/dry_run.py                                 # qwen2.toml at 64 ranks
    python bench/dry_run.py --configs mixtral_8x22b.toml:128
    python bench/dry_run.py --smoke                         # debug_moe.toml at 2 ranks (for tests)

Each run is a fresh process, as the user starts it. Figures per run: the CPU seconds the dry
run counts itself (its report's cpu_seconds: checks, the simulated ranks, the collective
phase), the process's CPU seconds with its imports, the wall seconds, and whether every
group's collectives matched.
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import script_parser, write_result  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def dry_run(config: str, ranks: int, collectives: bool, folder: str) -> dict:
    """One dry run in a fresh process: its figures."""
    report = os.path.join(folder, "dry_run.json")
    cmd = [
        sys.executable,
        "-m",
        "titan_fold.train",
        "--job.config_file",
        config,
        "--comm.mode",
        "fake_backend",
        "--job.dump_folder",
        folder,
        "--comm.dry_run_json",
        report,
    ]
    if not collectives:
        cmd.append("--comm.no-dry_run_collectives")
    env = dict(
        os.environ, NGPU=str(ranks), PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    )
    cpu, start = children_cpu_s(), time.monotonic()
    result = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    wall, cpu = time.monotonic() - start, children_cpu_s() - cpu
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    with open(report) as f:
        rep = json.load(f)
    return {
        "config": config,
        "ranks": ranks,
        "collectives": collectives,
        "matched": rep.get("collectives", {}).get("matched", False),
        "dry_run_cpu_s": rep["cpu_seconds"],
        "process_cpu_s": round(cpu, 1),
        "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    p = script_parser(__doc__, "dry_run", warmup=0, iters=1, smoke="debug_moe.toml at 2 ranks", device=False)
    p.add_argument("--configs", default="qwen2.toml:64", help="comma list of CONFIG:RANKS")
    a = p.parse_args(argv)
    configs = "debug_moe.toml:2" if a.smoke else a.configs
    rows = []
    for spec in configs.split(","):
        config, _, ranks = spec.partition(":")
        for collectives in (False, True):
            with tempfile.TemporaryDirectory() as folder:
                rows.append(dry_run(config, int(ranks), collectives, folder))
                print(rows[-1], flush=True)
    figures = {"rows": rows}
    write_result(a.name, figures, a.out_dir)
    return figures


if __name__ == "__main__":
    main()
