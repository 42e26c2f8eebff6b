"""Weight files of published checkpoints read into numpy without torch: safetensors
(``model.safetensors``) and PyTorch's zip pickles (``pytorch_model.bin``, ``best_model.pt``).

A PyTorch pickle can run any code it names. `read_torch_pickle` reads it with an unpickler that
admits only what a state dict is made of (tensors, their storages, ``OrderedDict`` and the plain
containers and scalars that pickle builds without a global); any other global is refused, naming
the file and the global.

>>> weights = read_weights(Path("gf-6L-30M-i2048"))   # doctest: +SKIP
"""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from ._errors import TrainError

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": jnp.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_STORAGES = {
    "DoubleStorage": np.float64,
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": jnp.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# what save_pretrained writes for a model larger than its max_shard_size: an index of which shard
# holds each tensor (``{"weight_map": {name: file}}``) beside the shards
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a ``.safetensors`` file: an 8-byte little-endian header size, a JSON header of
    ``name → {dtype, shape, data_offsets}``, then the raw little-endian data."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        (size,) = struct.unpack("<Q", raw[:8].tobytes())
        header = json.loads(raw[8 : 8 + size].tobytes())
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        msg = f"{path}: not a safetensors file ({e}); save the model with save_pretrained()"
        raise TrainError(msg) from None
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            msg = f"{path}: tensor {name} has dtype {info['dtype']}, not one of {', '.join(_SAFETENSORS_DTYPES)}"
            raise TrainError(msg)
        begin, end = (8 + size + int(o) for o in info["data_offsets"])
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<")
        out[name] = np.frombuffer(raw[begin:end], dtype=dtype).reshape(info["shape"])
    return out


class _StateDict(dict):
    """``collections.OrderedDict`` as a state dict pickles it: its ``_metadata`` attribute (module
    versions, set by pickle's BUILD) is dropped."""

    def __setstate__(self, state) -> None:
        pass


def _rebuild_tensor(storage, offset, shape, stride, *_):
    """``torch._utils._rebuild_tensor_v2`` for numpy: a strided view of the storage, copied."""
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=tuple(shape), strides=tuple(s * item for s in stride), writeable=False
    )
    return np.array(view)


def _rebuild_parameter(data, *_):
    return data


class _StateDictUnpickler(pickle.Unpickler):
    """Builds tensors (as numpy arrays) from a PyTorch zip pickle and nothing else."""

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, path: Path):
        super().__init__(file)
        self.archive, self.prefix, self.path = archive, prefix, path

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return _StateDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        msg = (
            f"{self.path}: refused to unpickle global {module}.{name} (only tensors, OrderedDict and plain "
            "containers are read); save the model's state_dict, or convert it with save_pretrained() "
            "to model.safetensors"
        )
        raise TrainError(msg)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            msg = f"{self.path}: unexpected persistent id {pid!r} (not a tensor storage)"
            raise TrainError(msg)
        _, dtype, key, _location, _numel = pid
        return np.frombuffer(
            self.archive.read(f"{self.prefix}data/{key}"), dtype=np.dtype(dtype).newbyteorder("<")
        )


def read_torch_pickle(path: Path) -> dict[str, np.ndarray]:
    """The state dict in a PyTorch zip checkpoint (``torch.save`` since 1.6: ``ARCHIVE/data.pkl``
    plus one ``ARCHIVE/data/N`` file per storage), as numpy arrays."""
    if not zipfile.is_zipfile(path):
        msg = (
            f"{path}: not a PyTorch zip checkpoint (legacy torch.save format or another file); "
            "re-save it with torch >= 1.6 or as model.safetensors"
        )
        raise TrainError(msg)
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            msg = f"{path}: expected one ARCHIVE/data.pkl in the zip, found {len(pickles)}"
            raise TrainError(msg)
        prefix = pickles[0][: -len("data.pkl")]
        byteorder = f"{prefix}byteorder"
        if byteorder in archive.namelist() and archive.read(byteorder) != b"little":
            msg = f"{path}: big-endian checkpoint; re-save it on a little-endian machine"
            raise TrainError(msg)
        with archive.open(pickles[0]) as f:
            try:
                obj = _StateDictUnpickler(f, archive, prefix, path).load()
            except TrainError:
                raise
            except Exception as e:  # noqa: BLE001 - any malformed pickle is the same one-line error
                msg = f"{path}: not a readable state dict ({type(e).__name__}: {e})"
                raise TrainError(msg) from None
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()
    ):
        msg = (
            f"{path}: holds {type(obj).__name__}, not a state dict of name -> tensor; save model.state_dict()"
        )
        raise TrainError(msg)
    return obj


def read_weights(directory: Path) -> tuple[dict[str, np.ndarray], Path]:
    """The weights of a Hugging Face checkpoint directory and the file they came from:
    ``model.safetensors`` if present, else ``pytorch_model.bin``, else the shards an index of
    either lists (`read_sharded`)."""
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            return _read_weight_file(path), path
    for name in INDEX_FILES:
        path = directory / name
        if path.is_file():
            return read_sharded(path), path
    msg = (
        f"{directory} holds none of {', '.join(WEIGHT_FILES + INDEX_FILES)}; save the model with "
        "save_pretrained(DIR)"
    )
    raise TrainError(msg)


def read_sharded(index: Path) -> dict[str, np.ndarray]:
    """The tensors of a sharded checkpoint: every shard its ``index`` (``*.index.json``) names, each
    tensor from the shard the index gives it (a shard missing, or without a tensor it should
    hold, is a one-line error)."""
    by_shard: dict[str, list[str]] = {}
    try:
        for name, shard in json.loads(index.read_text())["weight_map"].items():
            by_shard.setdefault(shard, []).append(name)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        msg = f"{index}: not a checkpoint index with a weight_map ({type(e).__name__}: {e})"
        raise TrainError(msg) from None
    out = {}
    for shard in sorted(by_shard):
        path = index.parent / shard
        if not path.is_file():
            msg = f"{index} lists shard {shard}, which is not in {index.parent}: copy every shard beside it"
            raise TrainError(msg)
        tensors = _read_weight_file(path)
        for name in by_shard[shard]:
            if name not in tensors:
                msg = f"{path} has no tensor {name}, which {index.name} places there"
                raise TrainError(msg)
            out[name] = tensors[name]
    return out


def _read_weight_file(path: Path) -> dict[str, np.ndarray]:
    """A ``.safetensors`` file, or else a PyTorch pickle (``.bin``)."""
    return (read_safetensors if path.name.endswith(".safetensors") else read_torch_pickle)(path)
