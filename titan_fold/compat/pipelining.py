"""The internals of torch 2.13's pipelining runtime that the overlapped schedule
(parallel/overlap.py) drives: its action type, its runtime schedule class and the private
methods and attributes one custom action reads, behind public names. torch's pipelining runs
a custom action (register_custom_function) with the schedule and context only; what torch's own
FORWARD / FULL_BACKWARD actions do with the stage (receive, run, cache, count the loss) is
reachable only through these private names."""

from torch.distributed.pipelining.schedules import _Action as Action
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime as PipelineScheduleRuntime
from torch.distributed.pipelining.schedules import _wait_batch_p2p as wait_batch_p2p

__all__ = ["Action", "PipelineScheduleRuntime", "wait_batch_p2p"]

# why (the re-exports above): torch 2.13 names them privately in pipelining.schedules:
# Action: one entry of a schedule's per-rank order (_Action)
# PipelineScheduleRuntime: the schedule that runs a given order with its P2P lowered (_PipelineScheduleRuntime)
# wait_batch_p2p: waiting on a stage's batched P2P receives (_wait_batch_p2p)


# why: the runtime lowers a compute-only order into one with its P2P sends and recvs
def prepare_with_comms(schedule, order: dict) -> None:
    schedule._prepare_schedule_with_comms(order)


# why: the stages, loss function and losses of a schedule are private attributes
def schedule_stages(schedule) -> list:
    return schedule._stages


def schedule_loss_fn(schedule):
    return schedule._loss_fn


def record_loss(schedule, loss) -> None:
    schedule._internal_losses.append(loss)


# why: torch's own actions check that FSDP has unsharded the stage's parameters
def assert_unsharded(schedule, stage) -> None:
    schedule._assert_unsharded(stage)


# why: a stage's received activations and gradients are read by private methods
def received_activations(stage, microbatch: int):
    return stage._retrieve_recv_activations(microbatch)


def received_grads(stage, microbatch: int):
    return stage._retrieve_recv_grads(microbatch)
