"""Step metrics: one readable line per logged step, one JSON object in metrics.jsonl, and an
end-of-run summary.

torchtitan's MetricsProcessor keeps the counters (tokens since the last log, data-loading
times) and the TensorBoard/W&B loggers; this subclass adds the MoE statistics, a memory
monitor that also works on the CPU, the JSON-lines file, the step line

    step N/TOTAL  loss L  grad_norm G  lr LR  tps TOKENS_PER_S  [mfu M%]  mem GIB  aux A  drop D  imbalance I  elapsed H:MM:SS  eta H:MM:SS

(`mfu` on a GPU only) and `summary()`. The first step of a run (1, or the one after the
resumed checkpoint), every `metrics.log_freq`-th and the last one are logged.

MFU = flops / seconds / peak_flops, per device. flops counts 6 * N_active per token plus
causal attention (`TransformerArgs.get_nparams_and_flops`), within each packed document under
document masking: the attention computed (the trainer's `batch_flops`). peak_flops is the
dense bf16 peak of the GPU's exact name (PEAK_BF16_FLOPS); null where there is none (the CPU).
"""

import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import (
    DeviceMemoryMonitor,
)
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from titan_fold.common.config import JobConfig
from titan_fold.compat.titan import MetricsProcessorHooks, metric_logger
from titan_fold.models.args import TransformerArgs
from titan_fold.models.mtp import mtp_stats_from, mtp_stats_values
from titan_fold.moe import moe_layers, moe_stats_from, moe_stats_values
from titan_fold.parallel.mesh import Layout
from titan_fold.trainer.expert_load import ExpertLoad
from titan_fold.trainer.metrics_file import METRICS_FILE, MetricsFile
from titan_fold.trainer.phases import StepPhases, phases_text
from titan_fold.trainer.policy import STAT_SUMS, PolicyStats, policy_metrics

GIB = 1024**3

# dense bf16 tensor-core peak (without sparsity), NVIDIA's datasheets, by the exact name that
# torch.cuda.get_device_name() gives: H100 SXM, PCIe and NVL differ by a quarter, and a name
# not here has no MFU (null) rather than a neighbour's peak
PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
}


def peak_flops(device_name: str) -> float:
    """The dense bf16 peak FLOP/s of the GPU named `device_name`; NaN where the table has no such name."""
    return PEAK_BF16_FLOPS.get(device_name, float("nan"))


class HostMemoryMonitor:
    """The CPU stand-in for torchtitan's DeviceMemoryMonitor: the process's peak RSS."""

    device_name = "cpu"

    def get_peak_gib(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is KiB on Linux

    def get_peak_stats(self) -> "_Peak":
        return _Peak(self.get_peak_gib(), _host_memory_gib())

    def reset_peak_stats(self) -> None:
        pass  # a process's peak RSS cannot be reset


class _Peak:
    def __init__(self, gib: float, capacity_gib: float):
        self.max_active_gib = self.max_reserved_gib = gib
        self.max_active_pct = self.max_reserved_pct = 100 * gib / capacity_gib
        self.num_alloc_retries = self.num_ooms = 0


def _memory_monitor() -> DeviceMemoryMonitor | HostMemoryMonitor:
    """torchtitan's monitor of the current GPU, or the host's peak RSS."""
    if torch.cuda.is_available():
        monitor = DeviceMemoryMonitor(f"cuda:{torch.cuda.current_device()}")
        logger.info(f"CUDA capacity: {monitor.device_name} with {monitor.device_capacity_gib:.2f}GiB memory")
        return monitor
    return HostMemoryMonitor()


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):  # no sysconf names on this OS
        return float("nan")


def _hms(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class FoldMetricsProcessor(MetricsProcessorHooks):
    """torchtitan's MetricsProcessor, built here: its memory monitor works on the CPU too, and
    no peak flops are made up where there is no GPU."""

    def __init__(self, job_config: JobConfig, parallel_dims: Layout, tag: str | None = None) -> None:
        loggers = metric_logger(job_config, parallel_dims, tag)
        monitor = _memory_monitor()
        # torchtitan's state (compat.titan); peak flops NaN on the CPU: no MFU
        self.init_state(job_config, parallel_dims, loggers, monitor, peak_flops(monitor.device_name))
        self.flops_since_last_log = 0.0  # the batches' training FLOPs (the trainer's batch_flops)
        # the trainer colours its lines with this too; escape codes only on a terminal
        colour = sys.stdout.isatty() and not job_config.metrics.disable_color_printing
        self.color = utils.Color() if colour else utils.NoColor()
        rank = dist.get_rank() if dist.is_initialized() else 0
        # rank 0's metrics.jsonl; FoldTrainer starts it once it knows the resumed step
        self.jsonl = MetricsFile(job_config.job.dump_folder) if rank == 0 else None
        self.history: list[dict[str, Any]] = []  # per logged step, for summary()
        self.phases: StepPhases | None = None  # metrics.step_phases: the trainer's StepPhases (phases.py)
        # a logged step's MoE, MTP and policy statistics on their way to the host (stage)
        self._staged: tuple[Any, ...] | None = None
        self.policy_stats: PolicyStats | None = None  # training.objective = "policy": the loss's (policy.py)
        self._expert_load: ExpertLoad | None = None  # metrics.expert_load, made at the first logged step
        self._last_logged_step: int | None = None
        self._first_step = 0  # the step this run started after (0, or the resumed checkpoint's)
        self.time_start = time.perf_counter()

    def begin(self) -> None:
        """Training starts now: the clock of the step line, ETA and summary."""
        self.time_start = self.time_last_log = time.perf_counter()

    def should_log(self, step: int) -> bool:
        # the trainer asks this at every step: the first call tells where this run
        # started (after a resume, not at step 1); that step is logged as step 1 is
        if self._last_logged_step is None:
            self._last_logged_step = self._first_step = step - 1
        return super().should_log(step) or step in (self._first_step + 1, self.job_config.training.steps)

    def stage(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """At a logged step, before the optimizer's kernels are queued: the MoE and MTP statistics'
        device values, each through copy(t) (HostCopies.copy), which log() reads once they have
        landed, without waiting for the optimizer step."""
        parts = self.model_parts or []
        values = (moe_stats_values(parts), mtp_stats_values(parts), self._policy_values())
        self._staged = tuple(v if v is None else copy(v) for v in values)

    def _policy_values(self) -> torch.Tensor | None:
        if self.policy_stats is None:
            return None
        values = self.policy_stats.values()
        # a rank that computed no loss (a pipeline stage before the last) adds zeros
        return values if values is not None else torch.zeros(len(STAT_SUMS) + 1)

    def _policy_metrics(self, values: torch.Tensor) -> dict[str, float | None]:
        """The policy objective's statistics over every rank's labelled tokens (policy.py): sums
        summed and the largest ratio's max over the world (tp ranks' copies leave the means as they are)."""
        if self.policy_stats is None:
            return {}
        values = values.to(torch.float64).cpu()
        if dist.is_initialized() and dist.get_world_size() > 1:
            sums, top = values[:-1].to(_comm_device()), values[-1:].to(_comm_device())
            dist.all_reduce(sums)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            values = torch.cat([sums.cpu(), top.cpu()])
        return policy_metrics(values.tolist())

    def _moe_stats(self, moe_values: torch.Tensor | None, mtp_values: torch.Tensor | None) -> dict[str, float | None]:
        parts = self.model_parts or []
        n_moe = float(len(moe_layers(parts)))
        stats = {**moe_stats_from(moe_values), **mtp_stats_from(mtp_values)}
        keys = ("moe_aux_loss", "dropped_token_frac", "expert_load_imbalance", "mtp_loss", "routing_replay_changed")
        values = torch.tensor([float(stats.get(k, float("nan"))) for k in keys], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # mean over the ranks that hold MoE layers (NaN marks a rank without any, e.g. a PP
            # stage), each rank's layer mean weighted by its number of layers: the mean over layers;
            # replay's share weighted by the rank's replayed routings: the share of all of them
            replayed = float(moe_values[-1]) if moe_values is not None else 0.0
            weights = torch.tensor([n_moe] * 3 + [1.0, replayed], dtype=torch.float64)
            have = (~values.isnan()).to(torch.float64) * weights
            both = torch.cat([values.nan_to_num(0.0) * have, have]).to(_comm_device())
            dist.all_reduce(both)
            values, have = both[: len(keys)].cpu(), both[len(keys) :].cpu()
            values = values / have
        return {k: (None if v != v else float(v)) for k, v in zip(keys, values.tolist(), strict=True)}

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Logs one step's values (the step line, metrics.jsonl, TensorBoard / W&B) -> its record."""
        phases = self.phases.finish() if self.phases is not None else None
        now = time.perf_counter()
        time_delta = now - self.time_last_log
        steps = max(1, self._steps_since_last_log(step))
        # tokens per second per device, as torchtitan counts them
        tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
        flops = self.flops_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
        mfu = 100 * flops / self.gpu_peak_flops
        memory = self.device_memory_monitor.get_peak_stats()
        extra = dict(extra_metrics or {})
        load = self._load(step)
        parts = self.model_parts or []
        moe_values, mtp_values, policy_values = self._staged or (
            moe_stats_values(parts),
            mtp_stats_values(parts),
            self._policy_values(),
        )
        self._staged = None
        record = {
            "step": step,
            "loss": global_avg_loss,
            "max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "lr": extra.pop("lr", None),
            "tokens_per_sec": tps,
            "tflops": flops / 1e12,
            "mfu": None if mfu != mfu else mfu,
            "max_memory_gib": memory.max_reserved_gib,
            **self._moe_stats(moe_values, mtp_values),
            **self._policy_metrics(policy_values),
            "time_per_step_s": time_delta / steps,
            **({"phases": phases} if phases else {}),
            **({"expert_load": load} if load is not None else {}),
            **extra,
        }
        # TensorBoard and W&B take numbers only (mfu and the MoE statistics can be null); a dict of
        # them (group_grad_norms) as one number per key
        flat = {
            f"{k}/{name}" if isinstance(v, dict) else k: value
            for k, v in record.items()
            for name, value in (v.items() if isinstance(v, dict) else [(k, v)])
        }
        self.logger.log({k: v for k, v in flat.items() if k != "step" and isinstance(v, (int, float))}, step)
        if self.jsonl:
            self.jsonl.write(record)
        self._last_logged_step = step
        self.history.append(
            {
                **record,
                "seconds": time_delta,
                "steps": steps,
                "tokens": self.ntokens_since_last_log,
                "flops": self.flops_since_last_log,
            }
        )
        logger.info(self._step_line(record, now))
        self.ntokens_since_last_log = 0
        self.flops_since_last_log = 0.0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()
        return record

    def _load(self, step: int) -> dict | None:
        """metrics.expert_load's summary (rank 0; every rank takes part in the sum)."""
        metrics = self.job_config.metrics
        if not metrics.expert_load:
            return None
        if self._expert_load is None:
            folder = self.job_config.job.dump_folder
            tensorboard = os.path.join(folder, metrics.save_tb_folder) if metrics.enable_tensorboard else None
            self._expert_load = ExpertLoad(self.model_parts or [], folder, self.parallel_dims.ep, tensorboard)
        return self._expert_load.collect(step)

    def _step_line(self, r: dict[str, Any], now: float) -> str:
        c, step, total = self.color, r["step"], self.job_config.training.steps
        parts = [
            f"{c.red}step {step:{len(str(total))}d}/{total}",
            f"{c.green}loss {r['loss']:7.4f}",
            f"{c.orange}grad_norm {r['grad_norm']:7.4f}",
            f"{c.cyan}lr {r['lr']:.2e}" if r["lr"] is not None else "",
            f"{c.blue}tps {round(r['tokens_per_sec']):,}",
            f"{c.magenta}mfu {r['mfu']:.2f}%" if r["mfu"] is not None else "",
            f"{c.turquoise}mem {r['max_memory_gib']:.2f}GiB",
            f"{c.yellow}aux {r['moe_aux_loss']:.4f}" if r["moe_aux_loss"] is not None else "",
            f"drop {r['dropped_token_frac']:.3f}" if r["dropped_token_frac"] is not None else "",
            f"imbalance {r['expert_load_imbalance']:.2f}" if r["expert_load_imbalance"] is not None else "",
            f"mtp {r['mtp_loss']:.4f}" if r["mtp_loss"] is not None else "",
            _policy_text(r),
            f"replay changed {r['routing_replay_changed']:.3f}" if r["routing_replay_changed"] is not None else "",
            phases_text(r["phases"]) if r.get("phases") else "",
            f"{c.white}elapsed {_hms(now - self.time_start)}  eta {_hms(self._eta(step, now))}{c.reset}",
        ]
        return "  ".join(p for p in parts if p)

    def _eta(self, step: int, now: float) -> float:
        """Remaining steps at the mean step time since the first logged step (which holds the
        warm-up: compilation, first allocations), or at the first one's while there is no other."""
        first = self.history[0]
        if step > first["step"]:
            per_step = (now - self.time_start - first["seconds"]) / (step - first["step"])
        else:
            per_step = first["seconds"] / first["steps"]
        return per_step * (self.job_config.training.steps - step)

    def summary(self, last_checkpoint: str | None = None) -> None:
        """Log what the run did: steps, losses, time, throughput after warm-up, memory, files."""
        if not self.history:
            return
        h, c = self.history, self.color
        # warm-up = the first logged interval (step 1: compilation, first allocations)
        steady = h[1:] or h
        seconds = sum(r["seconds"] for r in steady)
        tps = sum(r["tokens"] for r in steady) / (seconds * self.parallel_dims.non_data_parallel_size)
        mfu = (
            100
            * sum(r["flops"] for r in steady)
            / (seconds * self.parallel_dims.non_data_parallel_size)
            / self.gpu_peak_flops
        )
        best = min(h, key=lambda r: r["loss"])
        first_step, last_step = h[0]["step"] - h[0]["steps"] + 1, h[-1]["step"]
        lines = [
            f"{c.green}run summary: steps {first_step}-{last_step} of {self.job_config.training.steps} "
            f"in {_hms(time.perf_counter() - self.time_start)}; loss {h[0]['loss']:.4f} (step {h[0]['step']}) "
            f"-> {h[-1]['loss']:.4f} (step {last_step}), best {best['loss']:.4f} (step {best['step']}){c.reset}",
            f"  after warm-up (steps {steady[0]['step'] - steady[0]['steps'] + 1}-{last_step}): "
            f"{round(tps):,} tokens/s per device"
            + ("" if mfu != mfu else f", mfu {mfu:.2f}%")
            + f"; peak memory {max(r['max_memory_gib'] for r in h):.2f} GiB",
            f"  metrics: {os.path.join(self.job_config.job.dump_folder, METRICS_FILE)}",
        ]
        if self.job_config.metrics.enable_tensorboard:
            tb = os.path.join(self.job_config.job.dump_folder, self.job_config.metrics.save_tb_folder)
            lines.append(f"  tensorboard: {tb}  (tensorboard --logdir {tb})")
        if last_checkpoint:
            lines.append(f"  last checkpoint: {last_checkpoint}")
        for line in lines:
            logger.info(line)

    def _steps_since_last_log(self, step: int) -> int:
        return step - (self._last_logged_step or 0)


def _policy_text(r: dict[str, Any]) -> str:
    """The policy objective's part of the step line: ratio mean/max, clip fraction, log-prob gap, k3."""
    if r.get("policy_ratio_mean") is None:
        return ""
    return (
        f"ratio {r['policy_ratio_mean']:.3f}/{r['policy_ratio_max']:.3f}  clip {r['policy_clip_frac']:.3f}  "
        f"gap {r['logprob_gap']:.2e}  k3 {r['kl_k3']:.2e}"
    )


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def build_metrics_processor(
    job_config: JobConfig, parallel_dims: Layout, model_args: TransformerArgs | None = None, tag: str | None = None
) -> FoldMetricsProcessor:
    return FoldMetricsProcessor(job_config, parallel_dims, tag)
