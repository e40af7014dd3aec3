"""What jobs keep beside a model to skip work the next time: its layout, its kinds, and its limit.

Nothing here is a result. Each file is a pure function of what its name's key hashes (the worker's
``_cache_key``), so deleting one costs only computing it again. Under
``Settings.model_reference_dir(<model sha256>)``::

    <eval key>.safetensors        reference log-probs of the unquantized model on one evaluation text
                                  (quantcore.evaluation.reference.reference_cache_path)
    awq-<key>.safetensors         AWQ's searched input scales (quantcore.algorithms.awq.save_awq)
    kv-<key>.json                 the K/V maxima calibrated KV cache scales come from
    gptq/<key>.safetensors        one layer's GPTQ-rounded weight

A file is written whole or not at all (quantcore.files.write_whole: a ``.<name>.<uuid>.part`` renamed into
place). A read marks the file used (:func:`mark_used`, its mtime), and after each job that used them (score,
sensitivity: worker.runner.trim_cache) a worker deletes the least recently used files of all models until they fit
``Settings.cache_max_gib`` (:func:`trim`). A job that
finds its file gone or damaged computes it again, so a trim racing another job's read costs time, never a result.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)
#: The end of a file that quantcore.files.write_whole has not finished (or whose writer died). A copy, so the store
#: imports nothing of quantcore: tests/store/test_cache.py checks the two are equal.
PART_SUFFIX = ".part"

REFERENCE = "reference log-probs"
AWQ = "AWQ scales"
GPTQ = "GPTQ roundings"
KV = "KV cache amax"
KINDS = (REFERENCE, AWQ, GPTQ, KV)

_SUFFIXES = (".safetensors", ".json")
STALE_PART_S = 24 * 3600  # a .part nobody has written to for a day: its writer was killed (OOM, hard time limit)


def awq_path(folder: Path, key: str) -> Path:
    return Path(folder) / f"awq-{key}.safetensors"


def kv_path(folder: Path, key: str) -> Path:
    return Path(folder) / f"kv-{key}.json"


def gptq_path(folder: Path, key: str) -> Path:
    return Path(folder) / "gptq" / f"{key}.safetensors"


def kind_of(path: Path) -> str | None:
    """The kind of a kept file, None for anything else (a ``.part`` being written)."""
    path = Path(path)
    if path.suffix not in _SUFFIXES or path.name.startswith("."):
        return None
    if path.parent.name == "gptq":
        return GPTQ
    return AWQ if path.name.startswith("awq-") else KV if path.name.startswith("kv-") else REFERENCE


def _files(root: Path):
    """Every file under ``root`` with its stat; a file or folder removed while we look is passed over (os.walk
    ignores a folder gone before it is listed)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            f = Path(dirpath) / name
            try:
                yield f, f.stat()
            except FileNotFoundError:  # removed while we looked (a trim, a clear)
                continue


def _kept(root: Path) -> list[tuple[Path, str, os.stat_result]]:
    return [(f, kind, st) for f, st in _files(root) if (kind := kind_of(f)) is not None]


def kept_files(folder: Path) -> dict[str, tuple[int, int]]:
    """{kind: (files, bytes)} under one model's folder, every kind listed, (0, 0) where none is kept."""
    out = dict.fromkeys(KINDS, (0, 0))
    for _, kind, st in _kept(folder):
        n, size = out[kind]
        out[kind] = (n + 1, size + st.st_size)
    return out


def kept_bytes(root: Path) -> int:
    """The bytes of every kept file under ``root`` (one model's folder, or all models')."""
    return sum(st.st_size for _, _, st in _kept(root))


def mark_used(path: Path) -> None:
    """Note that a job read ``path`` now, so :func:`trim` deletes it after the files nobody has read since."""
    try:
        os.utime(path)
    except OSError:  # gone, or a read-only store: a trim may then take it sooner, which costs only time
        pass


def trim(root: Path, max_bytes: int, *, now: float | None = None) -> list[tuple[Path, int]]:
    """Delete the least recently used kept files under ``root`` (every model's) until the rest take at most
    ``max_bytes``, and any ``.part`` left a day unwritten (its writer died); returns what was deleted, (path,
    bytes) each. ``max_bytes`` <= 0: no limit, only the stale ``.part`` files go. A file this process may not
    delete (another user's, on a shared store) stops the trim with a warning rather than take fresher files
    in its place."""
    now = time.time() if now is None else now
    removed = []
    files = []
    for path, st in _files(root):
        if path.name.endswith(PART_SUFFIX):
            if now - st.st_mtime > STALE_PART_S and _unlink(path):
                removed.append((path, st.st_size))
        elif (kind := kind_of(path)) is not None:
            files.append((path, kind, st))
    if max_bytes <= 0:
        return removed
    files.sort(key=lambda f: f[2].st_mtime)  # the least recently used first
    total = sum(st.st_size for _, _, st in files)
    for path, _, st in files:
        if total <= max_bytes:
            break
        if not _unlink(path):
            break
        total -= st.st_size
        removed.append((path, st.st_size))
    return removed


def _unlink(path: Path) -> bool:
    """Delete ``path``; True when it is gone (another worker's trim may have taken it first)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not delete cached file %s (%s): the cache stays above its limit", path, exc)
        return False
    return True
