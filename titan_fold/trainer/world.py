"""Where a trainer runs: this process's device, its process group and the layout's meshes.

A real run's World (`World.of_this_process()`) computes on the GPU of its LOCAL_RANK, or on
the CPU where no GPU is visible, and brings its process group up over nccl or gloo to match.
torchtitan 0.2.2 decides the device once, at import ("cuda" even on a machine without a GPU),
and picks its backend, its barrier's device and its memory monitor from that decision; here
each is decided from the World's device. The dry run's World (dryrun/step.py) is handed the
layout it built on a fake process group.
"""

import contextlib
import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torchtitan.config import TORCH_DTYPE_MAP, Comm
from torchtitan.tools.logging import logger

from titan_fold.common.config import JobConfig
from titan_fold.common.device import device_type
from titan_fold.compat.titan import set_pg_timeouts
from titan_fold.parallel.mesh import Layout
from titan_fold.trainer.preflight import layout_from_config


@dataclasses.dataclass
class World:
    """device: where this process computes. layout: the meshes, when they exist already (the
    dry run's fake world); None: `layout()` brings the process group up and builds them."""

    device: torch.device
    given_layout: Layout | None = None

    @classmethod
    def of_this_process(cls) -> "World":
        return cls(torch.device(f"{device_type()}:{int(os.environ['LOCAL_RANK'])}"))

    def enter(self) -> None:
        """Make the device this process's current one (a GPU's kernels and allocations go there)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def layout(self, job_config: JobConfig) -> Layout:
        """The run's layout with both meshes built: the given one, or one over a new process group."""
        if self.given_layout is not None:
            return self.given_layout
        world_size = init_process_group(job_config.comm, job_config.job.dump_folder, self.backend)
        layout = layout_from_config(job_config, world_size)
        layout.build_mesh(self.device.type)
        return layout

    @property
    def backend(self) -> str:
        """nccl for a GPU, gloo for the CPU."""
        return dist.Backend.default_device_backend_map[self.device.type]

    def set_pg_timeouts(self, timeout: timedelta, layout: Layout) -> None:
        """Every group of the layout, and the world's, waits `timeout` from now on (after a
        barrier of all ranks: compat.titan.set_pg_timeouts)."""
        groups = [mesh.get_group() for mesh in layout.get_all_one_dimensional_meshes().values()] + [None]
        set_pg_timeouts(timeout, groups, self.device)


def init_process_group(comm_config: Comm, base_folder: str, backend: str) -> int:
    """The world's process group over `backend` (comm.init_timeout_seconds; NCCL's flight
    recorder as comm.trace_buf_size asks, dumped under job.dump_folder) -> world size. A
    process whose group is up already (a second trainer in one process) keeps it."""
    if dist.is_initialized():
        return dist.get_world_size()
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}  # skip cleanup: the flight recorder can dump
    env["TORCH_FR_BUFFER_SIZE"] = str(comm_config.trace_buf_size)
    if comm_config.trace_buf_size > 0:
        folder = os.path.join(base_folder, comm_config.save_traces_folder)
        os.makedirs(folder, exist_ok=True)
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        env["TORCH_FR_DUMP_TEMP_FILE"] = f"{folder}/{comm_config.save_traces_file_prefix}"
    for key, value in env.items():
        if os.environ.get(key, value) != value:
            logger.warning(f"ENV[{key}] = {os.environ[key]} will be overridden to {value} based on job config")
        os.environ[key] = value
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=comm_config.init_timeout_seconds))
    return dist.get_world_size()


def maybe_enable_amp(
    parallel_dims: Layout, mixed_precision_param: str, device_type: str
) -> contextlib.AbstractContextManager:
    """Compute in `training.mixed_precision_param` in every layout: FSDP2 casts where it wraps
    the model (any dp or cp), autocast everywhere else. torchtitan 0.2.2 computes tp or pp
    layouts without data parallelism in fp32, e.g. the folded tp 2 x ep 2 on 2 GPUs."""
    dtype = TORCH_DTYPE_MAP[mixed_precision_param]
    if parallel_dims.dp_cp_enabled or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
