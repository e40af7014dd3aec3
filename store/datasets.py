"""Uploaded calibration / evaluation texts: validated, stored content-addressed, registered."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Sized
from pathlib import Path

from store import repo
from store.db import session_scope
from store.records import DatasetRecord
from store.settings import Settings, get_settings

TEXT_SUFFIXES = (".txt", ".jsonl", ".cor")


def add_text_file(path: Path, *, role: str, read_documents: Callable[[Path], Sized], name: str | None = None,
                  settings: Settings | None = None) -> DatasetRecord:
    """Validate a .txt / .jsonl / .cor file, copy it under data_dir/<sha256><suffix> and register it.

    ``read_documents(path)`` reads the documents of the file (the caller's reader, e.g.
    ``quantcore.evaluation.text.load_documents``: the store does not parse texts), raising ValueError with the reason
    when the file yields none; it is called after the suffix is checked. Raises ValueError with the reason when the
    file is unusable."""
    s = settings or get_settings()
    path = Path(path)
    if path.suffix.lower() not in TEXT_SUFFIXES:
        raise ValueError(f"{path.name}: text must be one of {', '.join(TEXT_SUFFIXES)}")
    docs = read_documents(path)  # raises ValueError with the reason
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    data_dir = Path(str(s.data_dir))
    data_dir.mkdir(parents=True, exist_ok=True)
    rel = f"{digest}{path.suffix.lower()}"
    dest = data_dir / rel
    if not dest.exists():
        tmp = dest.with_suffix(dest.suffix + ".part")
        shutil.copyfile(path, tmp)
        tmp.replace(dest)
    with session_scope(s) as session:
        return repo.add_dataset(session, name=name or path.name, role=role, sha256=digest, path=rel,
                                n_documents=len(docs), n_bytes=dest.stat().st_size, user=s.user)
