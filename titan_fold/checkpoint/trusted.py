"""The trust boundary of DCP's files: `.metadata` is a pickle, and DCP's default planner reads
non-tensor values with `torch.load(weights_only=False)`. `read_metadata` unpickles `.metadata`
with an allow-list (DCP's metadata classes, torch.Size / dtype, paths, OrderedDict), and
`check_bytes_entries` test-loads every non-tensor entry with `torch.load(weights_only=True)`;
`check_storage_files` finds missing or truncated data files. The checkpoint manager
(manager.py) runs them before DCP reads anything.
"""

import io
import os
import pickle

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from titan_fold.common.errors import UserError


class CheckpointError(UserError, RuntimeError):
    pass


_ALLOWED_GLOBALS = {
    # what torch 2.13's DCP pickles into .metadata, nothing callable beyond constructors
    "torch.distributed.checkpoint.metadata": None,  # the classes defined in DCP's metadata module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {
        "Size",
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "float8_e4m3fn",
        "float8_e5m2",
    },
    "torch.serialization": {"_get_layout"},  # a lookup of torch.strided & co by name
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = _ALLOWED_GLOBALS.get(module, ())
        if allowed is not None and name in allowed:
            return super().find_class(module, name)
        if allowed is None:  # a module's own classes only, not what it imports
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise CheckpointError(f"refusing to unpickle {module}.{name}: not part of DCP's metadata")


def read_metadata(folder: str) -> Metadata:
    """DCP `.metadata` of `folder`, unpickled with an allow-list; errors name the folder."""
    path = os.path.join(folder, ".metadata")
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder}: no .metadata, not a complete DCP checkpoint")
    try:
        with open(path, "rb") as f:
            metadata = _RestrictedUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except Exception as e:  # truncated or garbage file
        raise CheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def check_storage_files(folder: str, metadata: Metadata) -> None:
    """Every data file the metadata points into exists and is long enough (a truncated or
    missing .distcp is caught here, before DCP has copied any tensor into the model)."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{folder}: data file {name} is missing")
        if os.path.getsize(path) < end:
            raise CheckpointError(f"{folder}: data file {name} is truncated ({os.path.getsize(path)} < {end} bytes)")


def check_bytes_entries(folder: str, metadata: Metadata) -> None:
    """Every non-tensor value must load with weights_only=True (DCP itself uses weights_only=False)."""
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, BytesStorageMetadata):
            continue
        info = metadata.storage_data.get(MetadataIndex(fqn))
        if info is None:
            raise CheckpointError(f"{folder}: no storage for {fqn!r}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{folder}: {fqn!r} is stored with transforms {info.transform_descriptors}")
        with open(os.path.join(folder, info.relative_path), "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        try:
            torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{folder}: entry {fqn!r} is not plain data ({type(e).__name__}); refusing to load"
            ) from None
