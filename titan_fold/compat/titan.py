"""torchtitan 0.2.2's private API, behind public names, and the torchtitan code titan_fold adapts."""

import os
import time
from datetime import datetime, timedelta

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    TensorBoardLogger,
    WandBLogger,
)
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger


# why: torchtitan 0.2.2's CheckpointManager keeps the folder naming, the save decision, the latest
# complete step, the async wait and the state selection in underscore methods; the subclass
# (checkpoint/manager.py) and api.py call them through these names
class CheckpointManagerHooks(CheckpointManager):
    def checkpoint_id(self, step: int) -> str:
        """The folder of step `step`'s checkpoint (step-N under checkpoint.folder)."""
        return self._create_checkpoint_id(step)

    def should_save(self, curr_step: int, last_step: bool) -> bool:
        return self._should_save(curr_step, last_step)

    def find_load_step(self) -> int:
        """The latest step with a complete checkpoint in the folder, or -1."""
        return self._find_load_step()

    def async_wait(self) -> None:
        self._async_wait()

    def states_to_load(self, model_only: bool) -> dict:
        return self._states_to_load(model_only=model_only)

    def flattened_model_states_sd(self) -> dict:
        return self._flattened_model_states_sd()


# why: torchtitan 0.2.2's OptimizersContainer.__init__ builds torch optimizers itself; a container
# that builds its own finishes with the two steps the base's __init__ ends with
class OptimizersContainerHooks(OptimizersContainer):
    def finish_init(self, n_model_parts: int, params: list, optimizer_kwargs: dict) -> None:
        """One optimizer per model part, then the container's step hooks and state-dict setup."""
        self._validate_length(n_model_parts)
        self._post_init(params, optimizer_kwargs)


# why: torchtitan 0.2.2's ParallelDims.__post_init__ validates through the private `_validate`;
# titan_fold's layout (parallel/mesh.py) validates its own degrees as `validate_degrees`
class ParallelDimsHooks(ParallelDims):
    def _validate(self) -> None:
        self.validate_degrees()

    def validate_degrees(self) -> None:
        raise NotImplementedError


# why: adapted from torchtitan 0.2.2's MetricsProcessor.__init__, whose memory monitor needs a GPU
# and whose peak flops are made up without one: the state its methods (should_log, log) read
class MetricsProcessorHooks(MetricsProcessor):
    def init_state(self, job_config, parallel_dims, logger, memory_monitor, peak_flops: float) -> None:
        """torchtitan's counters and loggers; the trainer sets optimizers, lr_schedulers and
        model_parts once built."""
        self.logger = logger
        self.parallel_dims = parallel_dims
        self.job_config = job_config
        self.device_memory_monitor = memory_monitor
        self.device_memory_monitor.reset_peak_stats()
        self.gpu_peak_flops = peak_flops
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []
        self.time_last_log = time.perf_counter()
        self.optimizers: OptimizersContainer | None = None
        self.lr_schedulers: LRSchedulersContainer | None = None
        self.model_parts: list[torch.nn.Module] | None = None


# why: adapted from torchtitan 0.2.2's components/metrics._build_metric_logger: the rank that holds
# the loss under any pipeline schedule, and a run that goes on without W&B
def metric_logger(job_config, parallel_dims, tag: str | None):
    """TensorBoard and W&B as metrics.enable_tensorboard / enable_wandb ask, on the rank that
    holds the loss (the first of the last pipeline stage; every rank with save_for_all_ranks),
    in job.dump_folder / metrics.save_tb_folder / the start time."""
    m = job_config.metrics
    last_stage = parallel_dims.pp_enabled and job_config.parallelism.pipeline_parallel_schedule != "ZBVZeroBubble"
    loss_rank = parallel_dims.world_size // parallel_dims.pp * (parallel_dims.pp - 1) if last_stage else 0
    if not (m.enable_tensorboard or m.enable_wandb) or not (m.save_for_all_ranks or dist.get_rank() == loss_rank):
        return BaseLogger()
    folder = os.path.join(job_config.job.dump_folder, m.save_tb_folder, datetime.now().strftime("%Y%m%d-%H%M"))
    if m.save_for_all_ranks:
        folder = os.path.join(folder, f"rank_{dist.get_rank()}")
    loggers = LoggerContainer()
    if m.enable_wandb:
        try:
            loggers.add_logger(WandBLogger(folder, job_config, tag))
        except Exception as e:  # a run goes on without W&B (as torchtitan's)
            logger.error(f"Failed to create WandB logger: {e}")
    if m.enable_tensorboard:
        loggers.add_logger(TensorBoardLogger(folder, tag))
    return loggers


# why: adapted from torchtitan 0.2.2's distributed/utils.set_pg_timeouts, which takes a world mesh;
# titan_fold's layout has two meshes, and torch sets a group's timeout only by a private call
def set_pg_timeouts(timeout: timedelta, groups: list, device: torch.device) -> None:
    """Every group in `groups` (None: the world's) waits `timeout` from now on. All ranks meet at a
    barrier first: a slow rank still under the long first-step timeout would otherwise see a fast
    one time out under the short one."""
    logger.info(f"Synchronizing and adjusting timeout for all ProcessGroups to {timeout}")
    if device.type == "cuda":
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
    else:
        dist.barrier()
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
