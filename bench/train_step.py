"""End-to-end tokens/s, MFU and peak memory of titan_fold's trainer on a proxy model.

    python bench/train_step.py --cases 1gpu_eager,1gpu_compiled --gpus 0
    python bench/train_step.py --cases dp2_ep2,dp2_etp2,dp2_edp2 --gpus 0,1
    python bench/train_step.py --cases debug50 --gpus 0          # the debug config itself, bf16
    python bench/train_step.py --cases 1gpu_bf16params_eager --gpus 0   # bf16 weights (training.dtype)
    python bench/train_step.py --cases dp2_ep2_bf16params_b4,dp2_ep2_bf16params_b4_ga2 --gpus 0,1
    python bench/train_step.py --cases 1gpu_masters_b4 --gpus 0   # bf16 weights, fp32 masters in the optimizer
    python bench/train_step.py --cases 1gpu_bf16params,1gpu_bf16params_fp8 --steps 200 --gpus 0  # FP8 experts
    python bench/train_step.py --cases 1gpu_bf16params_auxfree --family qwen3_moe --proxy 30B-A3B-L12 --gpus 0
    (modifiers, see parse_case: _compiled, _bf16params, _masters, _fp8 (moe.expert_kernels = "fp8"), _b<N> local
    batch N, _ga<N> N micro-batches per optimizer step, _profile traces step 10 and sums its kernels
    by class, _auxloss/_seqaux/_auxfree/_lbnone the moe.load_balance, _static / _device moe.exchange, _muon optimizer.name = "Muon",
    _overlap moe.ep_overlap = "batch", _delaywgrad its "wgrad", _docs training.document_masking,
    _stash<N> moe.stash_rows = N, _cudagraphs compile.cudagraphs, _phases metrics.step_phases)
    python bench/train_step.py --smoke                            # CPU, tiny proxy (tests)

The proxy has the real layer widths and fewer layers: flavor "<base>-L<n>" is
FLAVORS[family][base] with n_layers = n and vocab_size = 32768, registered in the worker
process before titan_fold.train.main runs (the default: qwen2_moe 57B-A14B-L2). Each
case is one `torchrun` of this file in worker mode; the trainer writes metrics.jsonl
(per-device tokens/s, MFU on the GPU's dense bf16 peak, peak reserved memory per logged step,
log_freq 1) and the parent reports medians over the steps after `--warmup-steps`.

Settings: seq 4096, local batch 2, bf16 compute with fp32 master weights
(training.mixed_precision_param = bfloat16: FSDP2's mixed precision on 2 GPUs, torchtitan's
AMP autocast on 1 GPU), no activation checkpointing, AdamW.

The worker also counts which kernels the routed experts ran (GroupedExperts.path: QuACK's
grouped GEMMs, torch's, FP8, padded batched GEMMs, or the per-expert loop, several times
slower): the row's expert_path_calls (eager calls) and expert_path_compiled (graphs compiled).
"""

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# expert foldings of the same 2 GPUs, under attention dp2 (FSDP2) or tp2 (sequence parallel)
FOLDINGS = {
    "dp2_ep2": dict(ep=2, etp=1, edp=1),
    "dp2_etp2": dict(ep=1, etp=2, edp=1),
    "dp2_edp2": dict(ep=1, etp=1, edp=2),
    "tp2_ep2": dict(tp=2, ep=2, etp=1, edp=1),  # folded: EP over the TP ranks
    "tp2_etp2": dict(tp=2, ep=1, etp=2, edp=1),  # unfolded: ETP = TP
    "pp2": dict(pp=2, ep=1, etp=1, edp=1),  # one stage per GPU, 1F1B over the local batch's sequences
    "cp2_ep2": dict(cp=2, ep=2, etp=1, edp=1),  # each sequence split over 2 GPUs; experts ep2 over them
}


def register_proxy(family: str, proxy: str) -> None:
    """FLAVORS[family][proxy] for proxy "<base>[-L<n>][-E<m>]": the base flavor with n layers and a
    32K vocabulary (-L), and with m routed experts (-E: the experts one EP rank holds, each token
    still routed to top_k of them, so that at balanced load the rank's expert rows per token are
    the full model's). A bare base flavor is left as it is."""
    from titan_fold.models import FLAVORS

    base, changes = proxy, {}
    for key, field in (("-E", "experts"), ("-L", "layers")):
        head, _, value = base.rpartition(key)
        if head and value.isdigit():
            base, changes[field] = head, int(value)
    if (family, base) == ("qwen3_moe", "57B-A14B"):
        FLAVORS[family][base] = _qwen3_at_qwen2_widths()
    if base not in FLAVORS[family] or (proxy != base and not changes):
        raise ValueError(f"proxy flavor {proxy!r}: expected '<base flavor>[-L<layers>][-E<experts>]'")
    args = FLAVORS[family][base]
    if "layers" in changes:
        vocab = args.vocab_size if base == "debug" else 32768
        # a hybrid family's first n layers keep its pattern of token mixers
        types = args.layer_types[: changes["layers"]]
        args = dataclasses.replace(args, n_layers=changes["layers"], vocab_size=vocab, layer_types=types)
    if "experts" in changes:
        if changes["experts"] < args.moe.top_k:
            raise ValueError(f"proxy flavor {proxy!r}: fewer experts than top_k = {args.moe.top_k}")
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, num_experts=changes["experts"]))
    FLAVORS[family][proxy] = args


def _qwen3_at_qwen2_widths():
    """Qwen3-MoE at Qwen2-57B-A14B's widths (the flavor "57B-A14B" of qwen3_moe in the benchmarks):
    q/k norms and no qkv bias, the shared expert of 20480 without its sigmoid gate, top-8 not
    renormalized: the model torchtitan's qwen3 builds at these widths."""
    from titan_fold.models import FLAVORS

    q2 = FLAVORS["qwen2_moe"]["57B-A14B"]
    return dataclasses.replace(
        q2, qk_norm=True, qkv_bias=False, moe=dataclasses.replace(q2.moe, shared_expert_gate=False)
    )


LOAD_BALANCE = {"auxloss": "aux_loss", "seqaux": "seq_aux_loss", "auxfree": "aux_free", "lbnone": "none"}


def parse_case(case: str) -> tuple[str, dict]:
    """ "<base>[_mod...]" -> (base, mods). base: 1gpu, debug50 or a key of FOLDINGS. mods:
    eager (the default), compiled, bf16params (bf16 weights, training.dtype), masters (bf16
    weights and fp32 master weights in the optimizer, optimizer.master_weights), b<N> (local
    batch N), ga<N> (N micro-batches per optimizer step), profile (trace step 10), fp8 (routed
    experts in FP8, moe.expert_kernels = "fp8"), auxloss / seqaux / auxfree / lbnone (moe.load_balance), torchgemm /
    quack (moe.expert_kernels), cudagraphs (compile.cudagraphs), static / device (moe.exchange), muon (optimizer.name), overlap (moe.ep_overlap = "batch"),
    delaywgrad (moe.ep_overlap "wgrad"; with overlap "batch_wgrad"), docs (training.document_masking: attention within each
    packed document), skew / uniform (each token's experts drawn from a fixed load:
    bench/forced_routing.py), replicas<N> (moe.hot_expert_replicas = N), expertload (metrics.expert_load:
    each layer's tokens per expert, expert_load.jsonl in the run folder), stash<N>
    (moe.stash_rows = N), phases (metrics.step_phases: host and GPU time per phase of each step), rerun (the
    same configuration once more, under a name of its own: the run-to-run spread in one call)."""
    base = next(
        (
            b
            for b in sorted(["1gpu", "debug50", *FOLDINGS], key=len, reverse=True)
            if case == b or case.startswith(b + "_")
        ),
        None,
    )
    if base is None:
        raise ValueError(f"case {case!r}: must start with one of 1gpu, debug50, {', '.join(FOLDINGS)}")
    mods = {
        "compiled": False,
        "bf16params": False,
        "masters": False,
        "fp8": False,
        "batch": None,
        "accum": 1,
        "profile": False,
        "load_balance": None,
        "grouped_gemm": None,
        "cudagraphs": False,
        "exchange": None,
        "muon": False,
        "overlap": False,
        "delaywgrad": False,
        "docs": False,
        "stash": 0,
        "replicas": 0,
        "routing": None,
        "expertload": False,
        "phases": False,
        "rerun": False,
    }
    for mod in filter(None, case[len(base) :].split("_")):
        if mod in (
            "compiled",
            "bf16params",
            "masters",
            "fp8",
            "profile",
            "cudagraphs",
            "phases",
            "rerun",
            "muon",
            "overlap",
            "delaywgrad",
            "docs",
            "expertload",
        ):
            mods[mod] = True
        elif mod in ("static", "device"):
            mods["exchange"] = mod
        elif mod in ("skew", "uniform"):
            mods["routing"] = mod
        elif mod in ("torchgemm", "quack"):
            mods["grouped_gemm"] = "torch" if mod == "torchgemm" else "quack"
        elif mod in LOAD_BALANCE:
            mods["load_balance"] = LOAD_BALANCE[mod]
        elif mod[:1] == "b" and mod[1:].isdigit():
            mods["batch"] = int(mod[1:])
        elif mod[:2] == "ga" and mod[2:].isdigit():
            mods["accum"] = int(mod[2:])
        elif mod[:5] == "stash" and mod[5:].isdigit():
            mods["stash"] = int(mod[5:])
        elif mod[:8] == "replicas" and mod[8:].isdigit():
            mods["replicas"] = int(mod[8:])
        elif mod != "eager":
            raise ValueError(f"case {case!r}: unknown modifier {mod!r}")
    return base, mods


def case_plan(case: str, a) -> tuple[int, list[str]]:
    """-> (processes, titan_fold.train arguments) of one case."""
    base, mods = parse_case(case)
    common = [
        "--job.config_file",
        "debug_moe.toml",
        "--metrics.log_freq",
        "1",
        "--optimizer.lr",
        "3e-4",
        "--lr_scheduler.warmup_steps",
        str(a.lr_warmup_steps),
        "--activation_checkpoint.mode",
        "none",
    ]
    if base == "debug50":
        # the debug config itself, bf16 on one GPU
        return 1, [
            "--job.config_file",
            "debug_moe.toml",
            "--training.steps",
            "50",
            "--training.mixed_precision_param",
            "bfloat16",
        ]
    nproc, degrees = (1, dict(ep=1, etp=1, edp=-1)) if base == "1gpu" else (2, FOLDINGS[base])
    tp, pp, cp = degrees.get("tp", 1), degrees.get("pp", 1), degrees.get("cp", 1)
    dp = nproc // (tp * pp * cp)
    batch = mods["batch"] or a.local_batch
    args = common + [
        "--model.name",
        a.family,
        "--model.flavor",
        a.proxy,
        "--training.seq_len",
        str(a.seq_len),
        "--training.local_batch_size",
        str(batch),
        "--training.global_batch_size",
        str(batch * dp * mods["accum"]),
        "--training.steps",
        str(a.steps),
        "--training.mixed_precision_param",
        a.param_dtype,
        "--parallelism.tensor_parallel_degree",
        str(tp),
        "--parallelism.pipeline_parallel_degree",
        str(pp),
        "--parallelism.context_parallel_degree",
        str(cp),
        "--parallelism.data_parallel_shard_degree",
        str(dp),
        "--parallelism.expert_parallel_degree",
        str(degrees["ep"]),
        "--parallelism.expert_tensor_parallel_degree",
        str(degrees["etp"]),
        "--parallelism.expert_data_parallel_degree",
        str(degrees["edp"]),
    ]
    if a.seq_len > 32768:  # past the proxies' RoPE tables (Qwen3: 40,960 positions)
        args += ["--model.max_seq_len", str(a.seq_len)]
    if mods["compiled"]:
        args.append("--compile.enable")
    if mods["bf16params"] or mods["masters"]:
        # bf16 parameters (no AMP autocast), activations reach the experts in bf16
        args += ["--training.dtype", "bfloat16"]
    if mods["masters"]:
        args += ["--optimizer.master_weights"]
    if kernels := "fp8" if mods["fp8"] else mods["grouped_gemm"]:
        args += ["--moe.expert_kernels", kernels]
    if mods["cudagraphs"]:
        args += ["--compile.cudagraphs"]
    if mods["exchange"]:
        args += ["--moe.exchange", mods["exchange"]]
    if mods["muon"]:
        args += ["--optimizer.name", "Muon"]
    if mods["overlap"] or mods["delaywgrad"]:
        overlap = ("batch" if mods["overlap"] else "") + ("_wgrad" if mods["delaywgrad"] else "")
        args += ["--moe.ep_overlap", overlap.lstrip("_")]
    if mods["docs"]:
        args += ["--training.document_masking", "True"]
    if mods["stash"]:
        args += ["--moe.stash_rows", str(mods["stash"])]
    if mods["replicas"]:
        args += ["--moe.hot_expert_replicas", str(mods["replicas"])]
    if mods["load_balance"]:
        args += ["--moe.load_balance", mods["load_balance"]]
        if mods["load_balance"] in ("aux_free", "none"):
            args += ["--moe.aux_loss_coeff", "0"]  # the config's coefficient would be refused as unused
    if mods["phases"]:
        args += ["--metrics.step_phases"]
    if mods["expertload"]:
        args += ["--metrics.expert_load"]
    if mods["profile"]:  # torchtitan's profiler traces step 10 (summarised by trace_summary.py)
        args += ["--profiling.enable_profiling", "--profiling.profile_freq", "10"]
    return nproc, args


def summarize(records: list[dict], warmup_steps: int) -> dict:
    """Medians over the logged steps after warm-up (peak memory: the max)."""

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    def med(xs):
        xs = sorted(x for x in xs if x is not None)
        if not xs:
            return None
        n = len(xs)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    steady = [r for r in records if r["step"] > warmup_steps]
    mem = [r["max_memory_gib"] for r in steady if r.get("max_memory_gib") is not None]
    out = {
        "steps_logged": len(records),
        "steps_measured": len(steady),
        "tokens_per_sec_per_gpu": med([r["tokens_per_sec"] for r in steady]),
        "mfu_pct": med([r.get("mfu") for r in steady]),
        "tflops_per_gpu": med([r.get("tflops") for r in steady]),
        "step_time_s": med([r.get("time_per_step_s") for r in steady]),
        "peak_memory_gib": max(mem) if mem else None,
        "loss_first": records[0]["loss"] if records else None,
        "loss_last": records[-1]["loss"] if records else None,
        "expert_load_imbalance": med([r.get("expert_load_imbalance") for r in steady]),
        # the end of a long run (the loss comparisons, the routers' balance)
        "loss_mean_last20": mean([r["loss"] for r in records[-20:]]),
        "expert_load_imbalance_mean_last20": mean([r.get("expert_load_imbalance") for r in records[-20:]]),
        "losses": [r["loss"] for r in records],
    }
    if steady and all("phases" in r for r in steady):  # metrics.step_phases: each phase's medians
        out["phases"] = {
            phase: {k: med([r["phases"].get(phase, {}).get(k) for r in steady]) for k in ("host_ms", "gpu_ms")}
            for phase in steady[-1]["phases"]
        }
    return out


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_group(cmd: list[str], env: dict, log, timeout: float):
    """Run cmd in its own process group; on timeout torchrun's workers write their Python stacks
    to the log (SIGUSR1, see worker), then they and torchrun's group are killed, so that they free
    the GPU for the next case (torchrun starts each worker in a session of its own: killing
    torchrun's group alone would leave them running). -> return code or "timeout"."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        workers = children(proc.pid)
        for pid in workers:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(3)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout"


def children(pid: int) -> list[int]:
    """The processes whose parent is pid (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def run_case(case: str, a) -> dict:
    nproc, train_args = case_plan(case, a)
    dump = os.path.join(a.work_dir, case)
    os.makedirs(dump, exist_ok=True)
    for stale in ("metrics.jsonl", "expert_path.json") if not a.rebuild else ():
        if os.path.exists(os.path.join(dump, stale)):
            os.remove(os.path.join(dump, stale))
    routing = parse_case(case)[1]["routing"]
    worker = ["bench/train_step.py", "--worker", "--family", a.family, "--proxy", a.proxy]
    worker += ["--forced-routing", routing, "--"] if routing else ["--"]
    launch = (
        ["--nproc_per_node", str(nproc), "--master_port", str(a.port)]
        + worker
        + train_args
        + ["--job.dump_folder", dump]
    )
    cmd = [sys.executable, "-m", "torch.distributed.run"] + launch
    env = dict(os.environ)
    if a.gpus:
        env["CUDA_VISIBLE_DEVICES"] = a.gpus
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = os.path.join(a.work_dir, f"{case}.log")
    shown = " ".join(shlex.quote(c) for c in ["torchrun"] + launch)
    print(f"[train_step] {case}: {shown}", flush=True)
    if a.rebuild:  # the run was cut off before this process could read what it left
        rc = "cut"
    else:
        with open(log_path, "w") as log:
            rc = run_group(cmd, env, log, a.case_timeout)
    records = read_jsonl(os.path.join(dump, "metrics.jsonl"))
    warm = 0 if case == "debug50" else a.warmup_steps
    row = {"case": case, "nproc": nproc, "returncode": rc, "command": shown, **summarize(records, warm)}
    base, mods = parse_case(case)
    if base != "debug50":
        row["folding"] = FOLDINGS.get(base, dict(ep=1, etp=1, edp=1))
        row["compiled"] = mods["compiled"]
        row["local_batch"] = mods["batch"] or a.local_batch
        row["micro_batches_per_step"] = mods["accum"]
    if mods["profile"]:
        from bench.trace_summary import find_trace, summarize_trace

        trace = find_trace(dump)
        row["trace_summary"] = summarize_trace(trace) if trace else None
    path_file = os.path.join(dump, "expert_path.json")
    if os.path.exists(path_file):
        with open(path_file) as f:
            paths = json.load(f)
        row["expert_path_calls"], row["expert_path_compiled"] = paths["calls"], paths["compiled"]
    row.update(log_flags(log_path))
    if any((row.get(key) or {}).get("loop") for key in ("expert_path_calls", "expert_path_compiled")):
        print(f"[train_step] {case}: the routed experts ran the per-expert loop, the slow fallback", flush=True)
    return finish_row("train_step", row, log_path)


def log_flags(log_path: str) -> dict:
    """Signs of a slow run in the worker's log: a float32 activation meeting bf16 weights
    (torch warns once: a residual stream promoted to float32) and, under
    TORCH_LOGS=recompiles, the recompiles."""
    with open(log_path) as f:
        text = f.read()
    return {
        "dtype_mismatch_warnings": text.count("Mismatch dtype between input and weight"),
        "recompiles": text.count("Recompiling function"),
    }


def finish_row(tag: str, row: dict, log_path: str) -> dict:
    """Attach the log's tail to a failed case's row and print the row (without the command)."""
    if row["returncode"] != 0:
        with open(log_path) as f:
            row["log_tail"] = f.read()[-1500:]
    print(
        f"[{tag}] {row['case']}: " + json.dumps({k: v for k, v in row.items() if k not in ("command", "log_tail")}),
        flush=True,
    )
    return row


def worker(argv: list[str], family: str, proxy: str, routing: str | None) -> None:
    """Runs under torchrun: register the proxy flavor, count the expert path, force the routing
    (skew / uniform cases), train. SIGUSR1 writes every thread's Python stack to the log (where a
    case that outlived its time hung)."""
    import faulthandler

    from bench.forced_routing import forced_routing
    from titan_fold.train import main as train_main

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    register_proxy(family, proxy)
    with counting_expert_paths() as paths, forced_routing(routing):
        try:
            code = train_main(argv)  # an exit code (an error, NaN stop, signal) is not an exception
        finally:
            if int(os.environ.get("RANK", "0")) == 0:
                dump = argv[argv.index("--job.dump_folder") + 1]
                with open(os.path.join(dump, "expert_path.json"), "w") as f:
                    json.dump(paths, f)
    if code:
        sys.exit(code)


@contextlib.contextmanager
def counting_expert_paths():
    """-> {"calls": {path: n}, "compiled": {path: n}}, filled while inside: the answers of
    GroupedExperts.path (moe/experts.py), the kernels each experts call runs: per call where it
    runs eagerly, and per graph it is compiled into under torch.compile (whose graphs run no
    Python: the count happens when traced, a constant to the compiler, neither traced nor
    guarded)."""
    import torch

    from titan_fold.moe.experts import GroupedExperts

    counts = {"calls": {}, "compiled": {}}

    @torch.compiler.assume_constant_result
    def compiled(path: str) -> bool:
        counts["compiled"][path] = counts["compiled"].get(path, 0) + 1
        return True

    def counted(self, *args):
        path = choose(self, *args)
        if torch.compiler.is_compiling():
            compiled(path)
        else:
            counts["calls"][path] = counts["calls"].get(path, 0) + 1
        return path

    choose = GroupedExperts.path
    GroupedExperts.path = counted
    try:
        yield counts
    finally:
        GroupedExperts.path = choose


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="1gpu_eager,1gpu_compiled")
    p.add_argument("--family", default="qwen2_moe")
    p.add_argument("--proxy", default="57B-A14B-L2")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--lr-warmup-steps", type=int, default=2, help="steps of the learning rate's linear warmup")
    p.add_argument("--param-dtype", default="bfloat16")
    p.add_argument("--gpus", default=None, help="CUDA_VISIBLE_DEVICES for the cases")
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--case-timeout", type=int, default=420)
    p.add_argument("--work-dir", default="/tmp/titan_fold_bench")
    p.add_argument("--name", default="train_step")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, debug-width proxy, 4 steps (tests)")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--forced-routing", choices=("skew", "uniform"), default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--rebuild",
        action="store_true",
        help="no training: the rows from the metrics and logs in "
        "--work-dir that a run cut off (e.g. by a device call's time limit) left, return code 'cut'",
    )
    a, rest = p.parse_known_args(argv)
    if a.smoke:
        a.proxy, a.seq_len, a.steps, a.warmup_steps, a.param_dtype = "debug-L2", 128, 4, 1, "float32"
    return a, rest


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        split = argv.index("--")
        a, _ = parse(argv[:split])
        worker(argv[split + 1 :], a.family, a.proxy, a.forced_routing)
        return {}
    a, _ = parse(argv)
    from bench.common import command_line, write_result

    rows = []
    figures = {
        "family": a.family,
        "proxy_flavor": a.proxy,
        "seq_len": a.seq_len,
        "local_batch": a.local_batch,
        "steps": a.steps,
        "warmup_steps": a.warmup_steps,
        "lr_warmup_steps": a.lr_warmup_steps,
        "mixed_precision_param": a.param_dtype,
        "rows": rows,
    }
    for case in a.cases.split(","):
        rows.append(run_case(case, a))
        by_case = {r["case"]: r for r in rows}
        for kind in ("", "_compiled"):
            folded, unfolded = by_case.get("dp2_ep2" + kind), by_case.get("dp2_etp2" + kind)
            if folded and unfolded and folded["tokens_per_sec_per_gpu"] and unfolded["tokens_per_sec_per_gpu"]:
                figures[f"ep2_over_etp2{kind}"] = folded["tokens_per_sec_per_gpu"] / unfolded["tokens_per_sec_per_gpu"]
        # after every case: a cut-off run keeps what it had
        write_result(a.name, figures, a.out_dir, command=command_line(["bench/train_step.py"] + argv))
    return figures


if __name__ == "__main__":
    main()
