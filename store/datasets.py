"""Uploaded calibration / evaluation texts: validated, stored content-addressed, registered."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from store import repo
from store.db import session_scope
from store.records import DatasetRecord
from store.settings import Settings, get_settings

TEXT_SUFFIXES = (".txt", ".jsonl", ".cor")


def add_text_file(path: Path, *, role: str, name: str | None = None,
                  settings: Settings | None = None) -> DatasetRecord:
    """Validate a .txt / .jsonl file (it must yield documents), copy it under data_dir/<sha256><suffix>
    and register it. Raises ValueError with the reason when the file is unusable."""
    from quantcore.evaluation.text import load_documents  # torch-free

    s = settings or get_settings()
    path = Path(path)
    if path.suffix.lower() not in TEXT_SUFFIXES:
        raise ValueError(f"{path.name}: text must be one of {', '.join(TEXT_SUFFIXES)}")
    docs = load_documents(path)  # raises ValueError with the reason
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
