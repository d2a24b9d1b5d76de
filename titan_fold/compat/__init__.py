"""Every private torch and torchtitan name titan_fold uses, and its adapted copies of torchtitan
code, in one place: each entry a small function, re-export or subclass hook with a `# why:` line
naming the behaviour of torch 2.13 / torchtitan 0.2.2 it adapts. Callers use the public names
here; tests/test_compat.py fails, naming file:line, on a private name used anywhere else.

    titan.py        torchtitan's underscore methods (checkpoint manager, optimizers container,
                    ParallelDims' validation hook) and its code adapted here (the metrics
                    processor's state, metric loggers, process-group timeouts)
    ops.py          torch's underscore ops and module internals (grouped GEMMs, foreach ops,
                    torch._check, dynamo marks, fake tensors, module hooks, wrapper names)
    distributed.py  torch.distributed's private modules and methods (functional collectives,
                    mesh flattening, group names, symmetric memory, strided shards,
                    activation-checkpoint wrappers, DCP's HF reader and storage info, the
                    ParallelStyle hook, the optimizer step swap)
    pipelining.py   the pipelining runtime's internals the overlapped schedule drives
    dispatch.py     what the dry run traces with: dispatch modes, pytree, fake process groups,
                    DTensor's sharding propagator and op schemas
"""
