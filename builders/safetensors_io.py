"""A safetensors reader that checks every offset and widens bfloat16 exactly.

numpy has no bfloat16, so the ``safetensors`` numpy loader cannot read bf16
checkpoints; this reader returns every float tensor as float32 (bf16 widened
bit-exactly) and turns a truncated or corrupt file into a :class:`CheckpointError`
naming the file, never a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triton_disagg.builders.errors import CheckpointError, one_line

_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes lie: ``file`` bytes ``[start, end)``, absolute offsets."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """(tensors, metadata) of one safetensors file, with every offset checked."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise CheckpointError(f"{path}: not a safetensors file (bad header length)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({one_line(exc)})") \
            from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not an object)")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64))
            ok = 0 <= lo <= hi <= size - 8 - n and hi - lo == count * _ITEMSIZE.get(dtype, hi - lo)
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}'") from exc
        if not ok:
            raise CheckpointError(f"{path}: tensor '{name}' lies outside the file (truncated?)")
        tensors[name] = TensorRef(path, dtype, shape, 8 + n + lo, 8 + n + hi)
    return tensors, metadata


def read_tensor(ref: TensorRef, name: str) -> np.ndarray:
    """The tensor as float32 (bfloat16 widened bit-exactly)."""
    if ref.dtype not in _NUMPY_DTYPES:
        raise CheckpointError(f"{ref.file}: tensor '{name}' has unsupported dtype {ref.dtype}")
    with ref.file.open("rb") as f:
        f.seek(ref.start)
        raw = f.read(ref.end - ref.start)
    if len(raw) != ref.end - ref.start:
        raise CheckpointError(f"{ref.file}: tensor '{name}' is truncated")
    array = np.frombuffer(raw, dtype=_NUMPY_DTYPES[ref.dtype]).reshape(ref.shape)
    if ref.dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)
