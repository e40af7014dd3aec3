"""A torch-free structural check of a GGUF file before transformers reads it: the header, every metadata entry and
every tensor's byte range must fit inside the file. A truncated or bogus file is refused with a sentence naming it,
never with the ``struct.error`` / ``IndexError`` text a reader raises deep inside (the traceback stays in the job's
row). Reads only the header and tables through a memory map; the tensor data is never touched.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from quantcore.errors import CheckpointError
from quantcore.safeload import display_name

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # version 1 (2023) used 32-bit counts; llama.cpp has written 3 since
MAX_TENSORS = 1_000_000
MAX_METADATA = 100_000
MAX_DIMS = 8
DEFAULT_ALIGNMENT = 32
# value type -> struct format of the fixed-size scalars (8: string, 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Damaged(Exception):
    """The file's tables do not fit it; the message says where."""


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise _Damaged("it ends inside its header")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> bytes:
        n = int(self.take("<Q"))
        if self.pos + n > len(self.data):
            raise _Damaged(f"a name of {n:,} bytes runs past the end of the file")
        out = bytes(self.data[self.pos: self.pos + min(n, 256)])
        self.pos += n
        return out

    def value(self, kind: int, depth: int = 0) -> int | float | bool | bytes | None:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY and depth < 2:
            item, count = int(self.take("<I")), int(self.take("<Q"))
            if item in _SCALARS:  # skip a scalar array at once
                size = struct.calcsize(_SCALARS[item]) * count
                if self.pos + size > len(self.data):
                    raise _Damaged(f"an array of {count:,} values runs past the end of the file")
                self.pos += size
            else:
                for _ in range(count):
                    self.value(item, depth + 1)
            return None
        raise _Damaged(f"a metadata value has unknown type {kind}")


def _tensor_bytes(kind: int, dims: list[int]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise _Damaged(f"a tensor has unknown type {kind}") from None
    n = 1
    for d in dims:
        n *= d
    return n // block * type_size


def _walk(data: mmap.mmap | bytes) -> None:
    cur = _Cursor(data)
    if bytes(data[:4]) != GGUF_MAGIC:
        raise _Damaged("it does not start with 'GGUF'")
    cur.pos = 4
    version = int(cur.take("<I"))
    if version not in GGUF_VERSIONS:
        raise _Damaged(f"its header says GGUF version {version}, not one of {GGUF_VERSIONS}")
    n_tensors, n_kv = int(cur.take("<Q")), int(cur.take("<Q"))
    if n_tensors > MAX_TENSORS or n_kv > MAX_METADATA:
        raise _Damaged(f"its header claims {n_tensors:,} tensors and {n_kv:,} metadata entries")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = cur.string()
        kind = int(cur.take("<I"))
        value = cur.value(kind)
        if key == b"general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    tensors = []
    for _ in range(n_tensors):
        cur.string()
        n_dims = int(cur.take("<I"))
        if n_dims > MAX_DIMS:
            raise _Damaged(f"a tensor claims {n_dims:,} dimensions")
        dims = [int(cur.take("<Q")) for _ in range(n_dims)]
        kind, offset = int(cur.take("<I")), int(cur.take("<Q"))
        tensors.append((offset, _tensor_bytes(kind, dims)))
    start = -(-cur.pos // alignment) * alignment
    end = max((offset + size for offset, size in tensors), default=0)
    if start + end > len(data):
        raise _Damaged(f"its tensors need {start + end:,} bytes but the file holds {len(data):,} (truncated)")


def check_gguf(path: Path) -> None:
    """Refuse a GGUF file whose header, metadata or tensor table does not fit it (CheckpointError naming it)."""
    path = Path(path)
    name = display_name(path.name)
    try:
        with path.open("rb") as handle:
            if path.stat().st_size < 24:
                raise _Damaged("it is too short to hold a GGUF header")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _walk(data)
    except _Damaged as exc:
        raise CheckpointError(f"{name} is not a usable GGUF file: {exc}; re-download or re-export it") from None
    except (OSError, ValueError, OverflowError, struct.error) as exc:
        raise CheckpointError(f"{name} is not a usable GGUF file: its header cannot be read "
                              f"({type(exc).__name__}); re-download or re-export it") from exc
