"""Shared pieces of the GPU benchmarks: environment record, timing, FLOP counts, result files.

Every benchmark writes `<out_dir>/<name>.json` (default out_dir: bench/results) holding
the exact command, the machine (GPU name and count, torch / CUDA / NCCL versions), the
date, and every figure it measured. Timings follow bench practice on a GPU: warm-up
first, CUDA events around each repeat, the median reported.
"""

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SCHEMA_KEYS = ("name", "command", "date_utc", "env", "figures")


def env_info() -> dict:
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # no NCCL in this build
            nccl = None
    return {
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu": _cpu_model(),  # host-bound (eager, fine-grained) figures follow the host CPU
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def command_line(argv: list[str] | None = None) -> str:
    """The command that reproduces this run (as typed, from the repository root)."""
    argv = sys.argv if argv is None else argv
    launcher = os.environ.get("BENCH_LAUNCHER")  # the torchrun prefix, where a wrapper launched us under it
    cmd = " ".join(shlex.quote(a) for a in argv)
    prefix = launcher + " " if launcher else ("python " if argv and argv[0].endswith(".py") else "")
    return prefix + cmd


def script_parser(
    doc: str, name: str, warmup: int, iters: int, smoke: str, device: bool = True
) -> argparse.ArgumentParser:
    """The command line every benchmark script shares, its docstring as --help: --device (where
    the script takes one; CUDA where there is one), --warmup and --iters (timing), --smoke (what
    the tests run: `smoke` says what it shrinks to), --name and --out-dir (write_result's). Each
    script adds its own flags."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if device:
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--name", default=name)
    p.add_argument("--out-dir", default=None)
    return p


def write_result(
    name: str, figures: dict, out_dir: str | None = None, command: str | None = None, extra: dict | None = None
) -> str:
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    record = {
        "name": name,
        "command": command or command_line(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "env": env_info(),
        "figures": figures,
        **(extra or {}),
    }
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(_clean(record), f, indent=1, sort_keys=False, default=_jsonable)
        f.write("\n")
    return path


def _clean(x):
    """NaN and inf are not JSON: write null."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    return x


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return str(x)


def gpu_reading(device: torch.device) -> dict:
    """The SM clock (MHz) and the board's power draw (W) NVML reports for the device's last sample
    period (1/6 s to 1 s): read right after a timed loop, the state the loop ended in (a card at
    its power limit lowers its clock). Each None on the CPU, without NVML's Python module
    (nvidia-ml-py) or where NVML cannot be read: they only annotate a timing."""
    reading = {"sm_clock_mhz": None, "power_w": None}
    if device.type == "cuda":
        try:
            reading["sm_clock_mhz"] = torch.cuda.clock_rate(device)
            reading["power_w"] = round(torch.cuda.power_draw(device) / 1e3, 1)  # NVML reports mW
        except Exception:  # pynvml missing (ModuleNotFoundError) or any NVMLError
            pass
    return reading


def median(xs):
    return statistics.median(xs) if xs else None


def time_ms(fn, warmup: int, iters: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `iters` calls of fn() after `warmup` calls.

    CUDA: a pair of events around each call (device time, no host sync inside the loop);
    CPU: wall clock around each call. Python's automatic garbage collection is off during
    the timed calls, after one collection, as in the trainer (torchtitan's gc_freq)."""
    for _ in range(warmup):
        fn()
    with _gc_off():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
            ]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)
            return [s.elapsed_time(e) for s, e in events]
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times


def graph_of(step, device):
    """step() captured in a CUDA graph after warm-up on a side stream; returns its replay. What
    step writes (outputs, gradients) lands in the same buffers each replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def host_us(fn, warmup: int, iters: int, repeats: int, device: torch.device) -> float:
    """Median over repeats of the host's microseconds per call of fn, the device idle at each start."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters * 1e6)
    sync()
    return statistics.median(times)


@contextlib.contextmanager
def _gc_off():
    enabled = gc.isenabled()
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def dense_gemm_tflops(
    device: torch.device, n: int = 8192, dtype=torch.bfloat16, warmup: int = 3, iters: int = 10, seconds: float = 0.0
) -> float:
    """bf16 n x n x n matrix product rate on random data, rotating over 3 input sets
    (the ceiling the MoE layer is compared with, measured in the same run). seconds > 0: as many
    timed products as last about that long, the rate the card holds under sustained load (the
    layer's timed loops run for up to seconds; a burst of a few products may run at clocks the
    card does not hold)."""
    gen = torch.Generator(device=device).manual_seed(0)
    sets = [
        (
            torch.randn(n, n, device=device, dtype=dtype, generator=gen),
            torch.randn(n, n, device=device, dtype=dtype, generator=gen),
        )
        for _ in range(3)
    ]
    out = torch.empty(n, n, device=device, dtype=dtype)
    i = [0]

    def mm():
        a, b = sets[i[0] % 3]
        i[0] += 1
        torch.mm(a, b, out=out)

    ms = median(time_ms(mm, warmup, iters, device))
    if seconds > 0:
        ms = median(time_ms(mm, 0, max(iters, math.ceil(seconds * 1e3 / ms)), device))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_tbps(device: torch.device, nbytes: int = 1 << 30, warmup: int = 3, iters: int = 20) -> float:
    """Device-to-device copy rate of nbytes of random float32 values, bytes read plus bytes written
    per second (TB/s): the memory ceiling, measured in the same run, that the layer's row movement
    and elementwise passes are compared with."""
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(nbytes // 4, device=device, generator=gen)
    dst = torch.empty_like(src)
    ms = median(time_ms(lambda: dst.copy_(src), warmup, iters, device))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


def moe_layer_flops(
    tokens: int,
    dim: int,
    ffn: int,
    top_k: int,
    num_experts: int,
    shared_ffn: int = 0,
    shared_gate: bool = False,
    kept_frac: float = 1.0,
) -> dict:
    """Forward + backward FLOPs of one MoE layer (SwiGLU experts), by part.

    A matmul of an [m, k] by a [k, n] costs 2mkn forward and 4mkn backward (input and
    weight gradients): 6mkn. Per token:
      routed experts  6 * top_k * 3 * dim * ffn   (w1, w3, w2; times kept_frac under token drop)
      shared expert   6 * 3 * dim * shared_ffn
      router          6 * dim * num_experts
      shared gate     6 * dim
    Elementwise work (SiLU, products, softmax, top-k, permutation) is not counted.
    """
    routed = 6 * tokens * top_k * kept_frac * 3 * dim * ffn
    shared = 6 * tokens * 3 * dim * shared_ffn
    router = 6 * tokens * dim * num_experts
    gate = 6 * tokens * dim if shared_gate else 0
    return {
        "routed": routed,
        "shared": shared,
        "router": router,
        "shared_gate": gate,
        "total": routed + shared + router + gate,
    }
