"""The device exchange's NVSHMEM op on 2 GPUs against NCCL: tests/gpu_device_exchange.py under
torchrun (the op alone with random splits, then the MoE layer at ep 2, eager and compiled)."""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a GPU: two, for the device exchange over ep 2")
def test_device_exchange_equals_nccl_on_two_gpus():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            os.path.join(HERE, "gpu_device_exchange.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "op: ok" in done.stdout, (done.stdout + done.stderr)[-6000:]
