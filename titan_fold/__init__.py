"""titan_fold: MoE Parallel Folding on torch.distributed, inside a torchtitan-style trainer."""

from titan_fold.device import settle_device

settle_device()
