"""What the dry run (and the profiler ranges of parallel/parallelize.py) trace with: torch's
dispatch modes, pytree, fake tensors and process groups, DTensor's sharding propagator and
op schemas, and the private attributes of ops and storages they read.

Each with a `# why:` line: no public equivalent in torch 2.13."""

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._pytree import tree_leaves

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "disable_current_modes",
    "reparametrize_module",
    "tree_leaves",
]

# why (the re-exports above): torch 2.13 keeps them in private modules or names:
# FakeTensor, FakeTensorMode: tensors without storage (torch._subclasses.fake_tensor)
# TorchDispatchMode, disable_current_modes: seeing every op below autograd (torch.utils._python_dispatch)
# tree_leaves: the tensors of nested outputs (torch.utils._pytree)
# reparametrize_module: a module run with other parameters in place (torch.nn.utils.stateless)


# why: torch's fake process group takes its store from torch.testing._internal, imported on use
def fake_store():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


# why: a dispatched op's name and schema are private attributes of its OpOverload
def op_name(func) -> str:
    """The op's qualified name with a dot: "c10d.allreduce_", "_c10d_functional.all_gather_into_tensor"."""
    return str(func.overloadpacket._qualified_op_name).replace("::", ".")


def op_schema_arguments(func) -> list:
    return func._schema.arguments


# why: c10d's ops carry their group as a ScriptObject, told apart only by its private type
def is_boxed_group(a) -> bool:
    return isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())


# why: a fake collective's result is waited on through the private functional-collectives op
def wait_tensor(t: torch.Tensor) -> None:
    torch.ops._c10d_functional.wait_tensor(t)


# why: a storage's identity across tensor views is its private C pointer
def storage_key(storage) -> int:
    return storage._cdata


# why: the local part of a DTensor without the autograd of to_local()
def local_tensor(t: DTensor) -> torch.Tensor:
    return t._local_tensor


# why: DTensor's sharding propagator is reached through the class's private dispatcher
def sharding_propagator():
    return DTensor._op_dispatcher.sharding_propagator


# why: DTensor's caches of sharding and redistribution decisions are keyed by mesh value, and
# cleared only through private functions (torch 2.13; each looked up, as it may be absent)
def clear_dtensor_caches() -> None:
    from torch.distributed.tensor import _redistribute

    prop = sharding_propagator()
    for cached in (
        prop.propagate_op_sharding,
        getattr(prop, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    ):
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ dispatch fast path's
        torch._C._clear_DTensor_sharding_propagator_cache()


# why: DTensor's sharding decisions and op schemas are classes of private modules
def dtensor_spec_class():
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return DTensorSpec


def op_schema_classes():
    """(OpSchema, OutputSharding)."""
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

    return OpSchema, OutputSharding
