"""titan_fold: MoE Parallel Folding on torch.distributed, inside a torchtitan-style trainer."""
