"""Step metrics: one readable line per logged step and one JSON object in metrics.jsonl.

torchtitan's MetricsProcessor keeps the counters (tokens since the last log, data-loading
times) and the TensorBoard/W&B loggers; this subclass adds the MoE statistics, a memory
monitor that also works on the CPU, and the JSON-lines file.

MFU = flops_per_token * tokens_per_sec / peak_flops, where flops_per_token counts the
activated parameters (6 * N_active) plus causal attention (see
`TransformerArgs.get_nparams_and_flops`); null where the peak is unknown (the CPU).
"""

import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import DeviceMemoryMonitor, MetricsProcessor
from torchtitan.tools.logging import logger

from titan_fold.metrics_file import MetricsFile
from titan_fold.moe import moe_stats
from titan_fold.torchtitan_adapter import with_names

GIB = 1024**3


class HostMemoryMonitor:
    """The CPU stand-in for torchtitan's DeviceMemoryMonitor: the process's peak RSS."""

    device_name = "cpu"

    def get_peak_gib(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is KiB on Linux

    def get_peak_stats(self):
        return _Peak(self.get_peak_gib())

    def reset_peak_stats(self) -> None:
        pass  # a process's peak RSS cannot be reset


class _Peak:
    def __init__(self, gib: float):
        self.max_active_gib = self.max_reserved_gib = gib
        self.max_active_pct = self.max_reserved_pct = float("nan")
        self.num_alloc_retries = self.num_ooms = 0


def _memory_monitor():
    # torchtitan's builds a CUDA monitor whatever the machine
    if torch.cuda.is_available():
        return DeviceMemoryMonitor(f"cuda:{torch.cuda.current_device()}")
    return HostMemoryMonitor()


class FoldMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        # torchtitan's __init__ with a memory monitor that works on the CPU too (torchtitan_adapter.py)
        with_names(MetricsProcessor.__init__, build_device_memory_monitor=_memory_monitor)(
            self, job_config, parallel_dims, tag)
        if not torch.cuda.is_available():
            self.gpu_peak_flops = float("nan")
        rank = dist.get_rank() if dist.is_initialized() else 0
        # rank 0's metrics.jsonl; FoldTrainer starts it once it knows the resumed step
        self.jsonl = MetricsFile(job_config.job.dump_folder) if rank == 0 else None

    def _moe_stats(self) -> dict[str, float | None]:
        stats = moe_stats(self.model_parts or [])
        keys = ("moe_aux_loss", "dropped_token_frac", "expert_load_imbalance")
        values = torch.tensor([float(stats.get(k, float("nan"))) for k in keys], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # mean over the ranks that hold MoE layers (NaN marks a rank without any, e.g. a PP stage)
            have = (~values.isnan()).to(torch.float64)
            both = torch.cat([values.nan_to_num(0.0), have]).to(_comm_device())
            dist.all_reduce(both)
            values, have = both[:3].cpu(), both[3:].cpu()
            values = values / have
        return {k: (None if v != v else float(v)) for k, v in zip(keys, values.tolist())}

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None):
        time_delta = time.perf_counter() - self.time_last_log
        # tokens per second per device, as torchtitan counts them
        tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
        flops = self.num_flops_per_token * tps
        mfu = 100 * flops / self.gpu_peak_flops
        memory = self.device_memory_monitor.get_peak_stats()
        extra = dict(extra_metrics or {})
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
            **self._moe_stats(),
            "time_per_step_s": time_delta / max(1, self._steps_since_last_log(step)),
            **extra,
        }
        self.logger.log(record, step)
        if self.jsonl:
            self.jsonl.write(record)
        self._last_logged_step = step
        c = self.color
        mfu_text = "n/a" if record["mfu"] is None else f"{record['mfu']:.2f}%"
        aux = record["moe_aux_loss"]
        logger.info(
            f"{c.red}step {step:4d}  {c.green}loss {global_avg_loss:8.4f}  {c.orange}grad_norm {grad_norm:7.4f}  "
            f"{c.turquoise}mem {memory.max_reserved_gib:6.2f}GiB  {c.blue}tps {round(tps):,}  "
            f"{c.magenta}mfu {mfu_text}  {c.yellow}aux {'n/a' if aux is None else f'{aux:.4f}'}  "
            f"drop {record['dropped_token_frac'] or 0:.3f}  imbalance {record['expert_load_imbalance'] or 0:.2f}{c.reset}"
        )
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()

    def _steps_since_last_log(self, step: int) -> int:
        return step - getattr(self, "_last_logged_step", 0)


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None) -> FoldMetricsProcessor:
    return FoldMetricsProcessor(job_config, parallel_dims, tag)
