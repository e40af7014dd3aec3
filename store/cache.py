"""What jobs keep beside a model to skip work the next time: its layout, its kinds, and its limit.

Nothing here is a result. Each file is a pure function of what its name's key hashes (the worker's
``_cache_key``), so deleting one costs only computing it again. Under
``Settings.model_reference_dir(<model sha256>)``::

    <eval key>.safetensors        reference log-probs of the unquantized model on one evaluation text
                                  (quantcore.scoring.reference_cache_path)
    awq-<key>.safetensors         AWQ's searched input scales (quantcore.awq.save_awq)
    kv-<key>.json                 the K/V maxima calibrated KV cache scales come from
    gptq/<key>.safetensors        one layer's GPTQ-rounded weight

A file is written whole or not at all (quantcore.files.write_whole: a ``.<name>.<uuid>.part`` renamed into
place). A read marks the file used (:func:`mark_used`, its mtime), and after each job a worker deletes the
least recently used files of all models until they fit ``Settings.cache_max_gib`` (:func:`trim`). A job that
finds its file gone or damaged computes it again, so a trim racing another job's read costs time, never a result.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("quantplan.cache")

REFERENCE = "reference log-probs"
AWQ = "AWQ scales"
GPTQ = "GPTQ roundings"
KV = "KV cache amax"
KINDS = (REFERENCE, AWQ, GPTQ, KV)

_SUFFIXES = (".safetensors", ".json")


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


def _kept(root: Path) -> list[tuple[Path, str, os.stat_result]]:
    out = []
    for f in Path(root).rglob("*") if Path(root).is_dir() else ():
        kind = kind_of(f)
        if kind is None:
            continue
        try:
            st = f.stat()
        except FileNotFoundError:  # removed while we looked
            continue
        if f.is_file():
            out.append((f, kind, st))
    return out


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


def trim(root: Path, max_bytes: int) -> list[tuple[Path, int]]:
    """Delete the least recently used kept files under ``root`` (every model's) until the rest take at most
    ``max_bytes``; returns what was deleted, (path, bytes) each. ``max_bytes`` <= 0: no limit, nothing deleted."""
    if max_bytes <= 0:
        return []
    files = sorted(_kept(root), key=lambda f: f[2].st_mtime)  # the least recently used first
    total = sum(st.st_size for _, _, st in files)
    removed = []
    for path, _, st in files:
        if total <= max_bytes:
            break
        try:
            path.unlink()
        except FileNotFoundError:  # another worker's trim took it
            pass
        except OSError as exc:
            log.warning("could not delete cached file %s: %s", path, exc)
            continue
        total -= st.st_size
        removed.append((path, st.st_size))
    return removed
