"""The files jobs keep beside the models (store.cache): their kinds, and the trim that keeps them under a limit."""

from __future__ import annotations

import os

from store import cache


def _write(path, size, mtime):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    os.utime(path, (mtime, mtime))
    return path


def test_kinds_follow_the_layout(tmp_path):
    folder = tmp_path / "reference" / "abc"
    assert cache.kind_of(folder / "0123.safetensors") == cache.REFERENCE
    assert cache.kind_of(cache.awq_path(folder, "k")) == cache.AWQ
    assert cache.kind_of(cache.kv_path(folder, "k")) == cache.KV
    assert cache.kind_of(cache.gptq_path(folder, "k")) == cache.GPTQ
    assert cache.kind_of(folder / ".kv-k.json.1f2e.part") is None  # quantcore.files.write_whole's file in progress
    assert cache.kind_of(folder / "notes.txt") is None


def test_kept_files_counts_each_kind(tmp_path):
    folder = tmp_path / "m"
    _write(folder / "e1.safetensors", 100, 1)
    _write(cache.awq_path(folder, "a"), 10, 1)
    _write(cache.gptq_path(folder, "g1"), 7, 1)
    _write(cache.gptq_path(folder, "g2"), 8, 1)
    _write(folder / ".e2.safetensors.99.part", 1000, 1)
    assert cache.kept_files(folder) == {cache.REFERENCE: (1, 100), cache.AWQ: (1, 10), cache.GPTQ: (2, 15),
                                        cache.KV: (0, 0)}
    assert cache.kept_bytes(folder) == 125
    assert cache.kept_files(tmp_path / "none") == dict.fromkeys(cache.KINDS, (0, 0))


def test_trim_deletes_the_least_recently_used_across_models(tmp_path):
    a, b = tmp_path / "reference" / "a", tmp_path / "reference" / "b"
    oldest = _write(a / "e.safetensors", 400, 100)
    read_since = _write(cache.gptq_path(b, "g"), 300, 200)
    newer = _write(cache.kv_path(a, "k"), 200, 300)
    newest = _write(cache.awq_path(b, "w"), 100, 400)
    part = _write(a / ".x.safetensors.1.part", 5000, 50)  # being written: neither counted nor deleted
    cache.mark_used(read_since)  # a job read it now: it is the most recently used
    assert cache.trim(tmp_path, 0) == []  # no limit
    removed = cache.trim(tmp_path, 500)
    assert removed == [(oldest, 400), (newer, 200)]  # 1000 -> 600 -> 400 bytes; the one read just now stays
    assert [p.exists() for p in (oldest, read_since, newer, newest, part)] == [False, True, False, True, True]
    assert cache.trim(tmp_path, 500) == []  # already under
    assert cache.kept_bytes(tmp_path) == 400
