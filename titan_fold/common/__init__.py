"""What every package may use: the job config, one-line user errors, the device, fused elementwise kernels."""
