"""Files written whole or not at all.

Jobs keep what they computed beside a model (reference log-probs, AWQ scales, GPTQ roundings, KV cache maxima) in a
folder that several workers, on one machine or several sharing it, may write at once and read at any time.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

PART_SUFFIX = ".part"  # the end of a file write_whole has not finished (or whose writer died)


def write_whole(path: str | Path, write: Callable[[str], Any]) -> Path:
    """``write(name)`` a file of a unique name beside ``path``, then rename it to ``path``: a reader finds the whole
    file or none, even with two writers at once; the unique file never stays behind (it starts with "." and ends
    with ".part"). It is created as any file is, with the process's umask, so other users of a shared folder read
    it as they read the rest (a ``tempfile.mkstemp`` file would be private to its writer)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{uuid.uuid4().hex}{PART_SUFFIX}")
    try:
        write(str(part))
        os.replace(part, path)
    finally:
        if part.exists():
            part.unlink()
    return path


__all__ = ["PART_SUFFIX", "write_whole"]
