"""quantcore.files.write_whole: what jobs keep beside a model appears whole or not at all, readable by the other
users of a shared folder."""

from __future__ import annotations

import os
import stat

import pytest

from quantcore.files import write_whole


def test_a_file_appears_whole_with_the_umask_mode_and_nothing_else_stays(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_whole(tmp_path / "a" / "kept.json", lambda part: open(part, "w").write("{}"))
    finally:
        os.umask(old)
    assert path.read_text() == "{}" and [p.name for p in path.parent.iterdir()] == ["kept.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not the 0600 of a tempfile.mkstemp file


def test_a_failed_write_leaves_the_old_file_and_no_part(tmp_path):
    path = tmp_path / "kept.json"
    path.write_text("old")

    def half(part: str) -> None:
        with open(part, "w") as f:
            f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(path, half)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["kept.json"]


def test_two_writers_each_leave_a_whole_file(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "kept.bin"
    payloads = [bytes([i]) * 1_000_000 for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda data: write_whole(path, lambda part: open(part, "wb").write(data)), payloads))
    assert path.read_bytes() in payloads and [p.name for p in tmp_path.iterdir()] == ["kept.bin"]
