"""The device this process computes on: "cuda" where a GPU is visible, else "cpu" (gloo).

torchtitan 0.2.2 decides once, at import, and falls back to "cuda" on a machine without a
GPU; titan_fold's trainer takes this answer instead (`titan_fold.trainer.world`).
"""

import torch


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
