"""Stored texts that calibration, score and sensitivity jobs read."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from quantcore.evaluation.text import load_documents  # torch-free
from quantplan.services import access
from quantplan.services.deployment import settings
from store import repo
from store.datasets import add_text_file
from store.db import session_scope
from store.records import DatasetRecord


def list_datasets() -> list[DatasetRecord]:
    """Every stored text."""
    with session_scope(settings()) as s:
        return repo.list_datasets(s)


def datasets_for(role: str) -> list[DatasetRecord]:
    """The stored texts a job may read in ``role`` (calibration or evaluation): those uploaded for it or for any."""
    return [d for d in list_datasets() if d.role in (role, "any")]


def add_dataset_file(path: Path, role: str) -> DatasetRecord:
    """Store the text file ``path`` (.txt, or .jsonl with a 'text' field) for ``role`` (calibration, evaluation or
    any); the same text stored again is the stored one. ValueError for a file that holds no text; access.Forbidden
    for a viewer."""
    access.require("upload_text")
    return add_text_file(path, role=role, read_documents=load_documents, settings=settings())


def upload_dataset(filename: str, data: bytes, role: str) -> DatasetRecord:
    """Store an uploaded text (.txt, or .jsonl with a 'text' field) for ``role``; ValueError for a file that holds
    no text."""
    s = settings()
    tmp = Path(str(s.data_dir)) / "incoming" / uuid.uuid4().hex
    tmp.mkdir(parents=True)
    try:
        path = tmp / Path(filename).name
        path.write_bytes(data)
        return add_dataset_file(path, role)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
