"""The files jobs keep beside the models (store.cache): their kinds, and the trim that keeps them under a limit."""

from __future__ import annotations

import os
import time

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
    part = _write(a / ".x.safetensors.1.part", 5000, time.time())  # being written: neither counted nor deleted
    cache.mark_used(read_since)  # a job read it now: it is the most recently used
    assert cache.trim(tmp_path, 0) == []  # no limit
    removed = cache.trim(tmp_path, 500)
    assert removed == [(oldest, 400), (newer, 200)]  # 1000 -> 600 -> 400 bytes; the one read just now stays
    assert [p.exists() for p in (oldest, read_since, newer, newest, part)] == [False, True, False, True, True]
    assert cache.trim(tmp_path, 500) == []  # already under
    assert cache.kept_bytes(tmp_path) == 400


def test_trim_takes_stale_partial_files_and_stops_at_one_it_may_not_delete(tmp_path, monkeypatch):
    """A .part a killed writer left a day ago goes (even with no limit); one being written stays. A file the trim
    may not delete (another user's, on a shared store) stops it rather than take fresher files in its place."""
    folder = tmp_path / "reference" / "a"
    stale = _write(folder / ".kv-k.json.1.part", 50, 1000)
    fresh = _write(folder / ".kv-j.json.2.part", 50, 1000 + cache.STALE_PART_S)
    assert cache.trim(tmp_path, 0, now=1001 + cache.STALE_PART_S) == [(stale, 50)] and fresh.exists()
    old = _write(folder / "e.safetensors", 100, 100)
    newer = _write(cache.awq_path(folder, "w"), 100, 200)
    real_unlink = type(old).unlink

    def unlink(self, *args, **kwargs):
        if self == old:
            raise PermissionError("not yours")
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(type(old), "unlink", unlink)
    assert cache.trim(tmp_path, 50, now=2000) == [] and old.exists() and newer.exists()


def test_a_tiny_limit_stays_a_limit_and_a_negative_one_is_refused(monkeypatch):
    import pytest
    from pydantic import ValidationError

    from store.settings import Settings

    assert Settings(cache_max_gib=1e-12).cache_max_bytes == 1
    assert Settings(cache_max_gib=0).cache_max_bytes == 0
    with pytest.raises(ValidationError):
        Settings(cache_max_gib=-1)


def test_the_store_names_unfinished_files_as_quantcore_writes_them():
    """store.cache keeps its own copy of the suffix (the store imports nothing of quantcore): the two must agree, or
    the trim would count a write in progress as a kept file."""
    from quantcore.files import PART_SUFFIX

    assert cache.PART_SUFFIX == PART_SUFFIX
