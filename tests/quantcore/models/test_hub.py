"""quantcore.models.hub against a local Hub (tests/hub_server.py): ids, resolving a revision to its commit, the
files picked, the size check, each failure's sentence, the download's progress and its resume after a cut."""

from __future__ import annotations

import pytest

from quantcore.errors import CheckpointError
from quantcore.models import hub as qhub
from tests.hub_server import (
    BIN_ONLY,
    GATED,
    MISSING,
    PRIVATE,
    PUBLIC,
    TOKEN,
    WIDE,
)


def _access(server, token: str | None = None) -> qhub.HubAccess:
    return qhub.HubAccess(endpoint=server.url, token=token)


@pytest.mark.parametrize(("text", "revision", "want"), [
    ("hf://meta-llama/Llama-3.1-8B-Instruct", None, ("meta-llama/Llama-3.1-8B-Instruct", "main")),
    ("hf://Qwen/Qwen3-30B-A3B@v1.0", None, ("Qwen/Qwen3-30B-A3B", "v1.0")),
    ("HF://org/name@refs/pr/3", None, ("org/name", "refs/pr/3")),
    ("org/name", "0123456789abcdef0123456789abcdef01234567", ("org/name", "0123456789abcdef0123456789abcdef01234567")),
    ("hf://org/name@dev", "dev", ("org/name", "dev")),
])
def test_a_hub_id_parses_to_its_repository_and_revision(text, revision, want):
    ref = qhub.parse_hub_ref(text, revision)
    assert (ref.repo_id, ref.revision) == want


@pytest.mark.parametrize(("text", "revision", "says"), [
    ("hf://just-a-name", None, "not a Hugging Face model id"),
    ("hf://org/name/extra", None, "not a Hugging Face model id"),
    ("hf://../etc@main", None, "not a Hugging Face model id"),
    ("hf://org/na--me", None, "not a Hugging Face model id"),
    ("hf://org/name@../x", None, "not a revision"),
    ("hf://org/name@dev", "main", "give one"),
])
def test_what_is_not_a_hub_id_is_refused_with_what_one_looks_like(text, revision, says):
    with pytest.raises(CheckpointError, match=says):
        qhub.parse_hub_ref(text, revision)


def test_a_revision_resolves_to_its_commit_with_the_model_files_and_their_sizes(hub):
    main, v1 = hub.repos[PUBLIC].refs["main"], hub.repos[PUBLIC].refs["v1"]
    listing = qhub.resolve(qhub.parse_hub_ref(f"hf://{PUBLIC}@main"), _access(hub))
    assert listing.commit == main and listing.source_name == f"hf://{PUBLIC}@{main}"
    files = hub.repos[PUBLIC].commits[main]
    assert {f.name: f.size for f in listing.files} == {n: len(b) for n, b in files.items()}
    assert listing.total_bytes == sum(len(b) for b in files.values())
    assert listing.weight_bytes == len(files["model.safetensors"])
    assert qhub.resolve(qhub.parse_hub_ref(f"hf://{PUBLIC}@v1"), _access(hub)).commit == v1 != main
    assert qhub.resolve(qhub.parse_hub_ref(PUBLIC, v1), _access(hub)).commit == v1  # a commit is its own answer
    assert not any("Authorization" in h for _, _, h in hub.requests)  # no token set: none sent


def test_pickles_and_code_are_left_out_and_a_bin_only_repository_is_refused_before_any_download(hub):
    repo = hub.repos[PUBLIC]
    files = dict(repo.commits[repo.refs["main"]])
    repo.add_commit({**files, "pytorch_model.bin": b"pickle", "modeling_evil.py": b"import os",
                     "README.md": b"# hi", "original/consolidated.00.pth": b"pickle",
                     "original/tokenizer.model": b"x"}, ref="with-extras")
    listing = qhub.resolve(qhub.parse_hub_ref(f"hf://{PUBLIC}@with-extras"), _access(hub))
    assert sorted(f.name for f in listing.files) == sorted(files)  # top level, model files only
    assert listing.left_out == ("README.md", "modeling_evil.py", "pytorch_model.bin")
    with pytest.raises(CheckpointError) as err:
        qhub.resolve(qhub.parse_hub_ref(f"hf://{BIN_ONLY}"), _access(hub))
    assert "pickle files (pytorch_model.bin)" in str(err.value) and "nothing was downloaded" in str(err.value)
    assert not [p for m, p, _ in hub.requests if "/resolve/" in p]


@pytest.mark.parametrize(("repo", "revision", "token", "says"), [
    (GATED, "main", None, f"hf://{GATED}@main is a gated repository and no token"),
    (GATED, "main", TOKEN, "gated repository and the token in QUANTPLAN_HF_TOKEN has no access"),
    (MISSING, "main", None, "no such repository on the Hub"),
    (PRIVATE, "main", None, "or it is private and no token was given: set QUANTPLAN_HF_TOKEN"),
    (PUBLIC, "no-such-branch", None, f"{PUBLIC} has no revision 'no-such-branch' on the Hub"),
    (PUBLIC, "main", "hf_wrong", "the Hub refused the token in QUANTPLAN_HF_TOKEN (401, invalid credentials)"),
    (PRIVATE, "main", "hf_wrong", "the Hub refused the token in QUANTPLAN_HF_TOKEN (401"),
])
def test_each_hub_failure_ends_with_a_sentence_that_says_which(hub, repo, revision, token, says):
    with pytest.raises(CheckpointError) as err:
        qhub.resolve(qhub.HubRef(repo, revision), _access(hub, token))
    assert says in str(err.value)
    assert TOKEN not in str(err.value) and "hf_wrong" not in str(err.value)


def test_a_private_repository_resolves_with_its_token_sent_as_a_bearer(hub):
    listing = qhub.resolve(qhub.HubRef(PRIVATE), _access(hub, TOKEN))
    assert listing.commit == hub.repos[PRIVATE].refs["main"]
    assert all(h.get("Authorization") == f"Bearer {TOKEN}" for _, _, h in hub.requests)
    assert TOKEN not in repr(_access(hub, TOKEN))  # the token is kept out of the access's repr


def test_no_network_and_offline_mode_each_say_so(hub, monkeypatch):
    from tests.factories import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(CheckpointError, match=f"cannot reach the Hub at {closed}"):
        qhub.resolve(qhub.HubRef(PUBLIC), qhub.HubAccess(endpoint=closed))
    assert qhub.unreachable_reason(closed, timeout=1).startswith(f"no answer from {closed}")
    assert qhub.unreachable_reason(hub.url) is None
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert qhub.unreachable_reason(hub.url) == "HF_HUB_OFFLINE is set"
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE is set"):
        qhub.resolve(qhub.HubRef(PUBLIC), _access(hub))


def test_a_repository_over_the_size_setting_or_the_free_space_is_refused_with_both_numbers(hub):
    listing = qhub.resolve(qhub.HubRef(PUBLIC), _access(hub))
    total = listing.total_bytes
    with pytest.raises(CheckpointError) as err:
        qhub.check_room(listing, free_bytes=10 * total, max_bytes=total // 2)
    text = str(err.value)
    assert "QUANTPLAN_HUB_MAX_GIB" in text and qhub.human_size(total // 2) in text
    assert qhub.human_size(listing.weight_bytes) in text
    with pytest.raises(CheckpointError) as err:
        qhub.check_room(listing, free_bytes=total // 3, max_bytes=0)
    assert f"need {qhub.human_size(total)} more" in str(err.value)
    assert f"has {qhub.human_size(total // 3)} free" in str(err.value)
    qhub.check_room(listing, free_bytes=total // 3, max_bytes=0, present_bytes=total)  # what a try left counts
    qhub.check_room(listing, free_bytes=total, max_bytes=total)


def test_a_transfer_cut_short_resumes_with_a_range_request_and_reports_every_byte(hub, tmp_path):
    listing = qhub.resolve(qhub.HubRef(WIDE), _access(hub))
    weights = next(f for f in listing.files if f.name == "model.safetensors")
    cut = 12 * 2**20  # past huggingface_hub's first 10 MiB chunk, which it has written when the cut comes
    assert weights.size > cut + 2**20
    hub.cut_after[(WIDE, "model.safetensors")] = cut
    seen: list[int] = []
    dest = qhub.download(listing, tmp_path / "dl", _access(hub), on_bytes=seen.append)
    files = hub.repos[WIDE].commits[listing.commit]
    assert {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file()} == files  # byte for byte
    gets = hub.gets(WIDE, "model.safetensors")
    assert len(gets) == 2 and "Range" not in gets[0]
    start = int(gets[1]["Range"].removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= cut  # resumed from the bytes it had, not from 0
    assert max(seen) == listing.total_bytes == qhub.present_bytes(listing, dest)


def test_a_failed_download_keeps_the_files_it_completed_and_a_retry_fetches_only_the_rest(hub, tmp_path):
    listing = qhub.resolve(qhub.HubRef(PUBLIC), _access(hub))
    hub.broken.add((PUBLIC, "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        qhub.download(listing, tmp_path / "dl", _access(hub), max_workers=1)
    assert "answered 500" in str(err.value) and "A retry resumes the download" in str(err.value)
    kept = qhub.present_bytes(listing, tmp_path / "dl")
    assert 0 < kept < listing.total_bytes
    hub.broken.clear()
    before = {f.name: len(hub.gets(PUBLIC, f.name)) for f in listing.files}
    qhub.download(listing, tmp_path / "dl", _access(hub))
    again = {f.name: len(hub.gets(PUBLIC, f.name)) - before[f.name] for f in listing.files}
    completed = {f.name for f in listing.files if f.name != "model.safetensors" and before[f.name]}
    assert completed and all(again[n] == 0 for n in completed)  # what the failed try completed is not fetched again
    assert again["model.safetensors"] == 1 and all(again[n] == 1 for n in again if not before[n])
    assert qhub.present_bytes(listing, tmp_path / "dl") == listing.total_bytes


def test_the_progress_line_says_bytes_of_the_total_and_the_time_left_at_the_rate_seen(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(qhub.time, "monotonic", lambda: clock[0])
    meter = qhub.RateMeter(total=10 * 2**30, start=2**30)  # 1 GiB from an earlier try
    assert meter.line(2**30, "org/name@abc") == "downloading org/name@abc: 1.0 GiB of 10.0 GiB"
    clock[0] += 10.0  # 1 GiB in 10 s: 8 GiB left take 80 s
    assert meter.line(2 * 2**30, "org/name@abc") == "downloading org/name@abc: 2.0 GiB of 10.0 GiB, about 80 s left"
    clock[0] += 10.0 * 60
    # 2 GiB in 610 s: 7 GiB left take 2,135 s
    assert meter.line(3 * 2**30, "x").endswith("3.0 GiB of 10.0 GiB, about 36 min left")
    assert meter.fraction(3 * 2**30) == 0.3 and meter.line(10 * 2**30, "x").endswith("10.0 GiB of 10.0 GiB")
