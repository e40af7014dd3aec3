"""Checkpoints from the Hugging Face Hub: ``hf://ORG/NAME[@REVISION]``, resolved, sized and downloaded.

A registration by hub id resolves the revision to its commit (:func:`resolve`), picks from the repository's top
level the files a model needs (:data:`HUB_ALLOW_PATTERNS`, the same list an upload is cut to: config, safetensors,
their index, tokenizer and generation files; never a pickle such as ``*.bin`` / ``*.pt`` nor Python code), refuses
a repository without safetensors weights or one too large for the artifact store (:func:`check_room`) before any
byte is fetched, then downloads them with ``huggingface_hub.snapshot_download`` into a staging folder
(:func:`download`); :func:`quantcore.models.intake.register_checkpoint` validates and stores them as it does an
upload. Each failure of the Hub (gated, missing, a wrong token, an unknown revision, no network, ``HF_HUB_OFFLINE``)
becomes a :class:`~quantcore.errors.CheckpointError` whose sentence says which (:func:`hub_error`).

The token is passed to ``huggingface_hub`` alone: it is never part of a message, a log line or a dataclass's repr
here (:class:`HubAccess`), and without one no token is sent at all (``token=False``: not even one a machine's
``huggingface-cli login`` left). The endpoint (``HF_ENDPOINT``, a company mirror) is passed explicitly on every
call, since ``huggingface_hub`` reads its own default once, when it is imported. Importing this module imports
neither torch, transformers nor huggingface_hub.
"""

from __future__ import annotations

import glob
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantcore.errors import CheckpointError
from quantcore.models.validation import (
    CONFIG_FILE,
    MODEL_FILE_PATTERNS,
    check_config,
    check_model_type,
    check_weight_files,
    human_size,
    is_pickle,
    matches_any,
)
from quantcore.safeload import short

HUB_SCHEME = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
HUB_ALLOW_PATTERNS = MODEL_FILE_PATTERNS  # what is downloaded: what a model needs, never a pickle or .py file
# a repo id as the Hub allows one: ORG/NAME, each part letters, digits, '-', '_', '.' (no '--' or '..'), <= 96 chars
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_ID_RE = re.compile(rf"^{_PART}/{_PART}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")  # a branch, tag or commit; no '..' (checked below)
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
TOKEN_ENV = "QUANTPLAN_HF_TOKEN"
REACH_TIMEOUT_S = 2.0  # the Models page's reachability check: a person waits on it
API_TIMEOUT_S = 30.0  # model info and file list calls of a registration job


@dataclass(frozen=True)
class HubRef:
    """A model on the Hub: its repository id and the revision asked for (a branch, tag or commit)."""

    repo_id: str
    revision: str = DEFAULT_REVISION

    @property
    def uri(self) -> str:
        """``hf://ORG/NAME@REVISION``."""
        return f"{HUB_SCHEME}{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class HubAccess:
    """How a registration reaches the Hub: the endpoint (``HF_ENDPOINT``) and the token (QUANTPLAN_HF_TOKEN, or
    None: none is sent). The token is left out of the repr, so printing or logging this never shows it."""

    endpoint: str = DEFAULT_ENDPOINT
    token: str | None = field(default=None, repr=False)

    @property
    def hf_token(self) -> str | bool:
        """What huggingface_hub's ``token=`` takes: the token, or False (send none, read none from the machine)."""
        return self.token or False

    def scrub(self, text: str) -> str:
        """``text`` with the token, should a library have quoted it, replaced by ``***``."""
        return text.replace(self.token, "***") if self.token else text


@dataclass(frozen=True)
class HubFile:
    """One file of a repository's top level that a registration downloads."""

    name: str
    size: int


@dataclass(frozen=True)
class HubListing:
    """A repository at a resolved commit: the files a model needs from it (:data:`HUB_ALLOW_PATTERNS`) and the
    top-level files left out (pickles, code, READMEs...)."""

    ref: HubRef
    commit: str
    files: tuple[HubFile, ...]
    left_out: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the safetensors weights alone."""
        return sum(f.size for f in self.files if f.name.endswith(".safetensors"))

    @property
    def source_name(self) -> str:
        """``hf://ORG/NAME@<commit>``: what the model row records, and how a later registration finds it."""
        return commit_uri(self.ref.repo_id, self.commit)


def commit_uri(repo_id: str, commit: str) -> str:
    """``hf://ORG/NAME@<commit>``."""
    return f"{HUB_SCHEME}{repo_id}@{commit}"


def is_hub_ref(text: str | None) -> bool:
    """Whether ``text`` names a hub model (``hf://...``) rather than a path."""
    return bool(text) and str(text).strip().lower().startswith(HUB_SCHEME)


def parse_hub_ref(text: str, revision: str | None = None) -> HubRef:
    """``hf://ORG/NAME[@REVISION]`` or ``ORG/NAME`` (with ``revision`` apart: ``--hub ORG/NAME --revision REV``)
    as a :class:`HubRef`; CheckpointError saying what a hub id looks like otherwise."""
    raw = str(text).strip()
    body = raw[len(HUB_SCHEME):] if raw.lower().startswith(HUB_SCHEME) else raw
    repo_id, at, rev = body.partition("@")
    repo_id = repo_id.strip().strip("/")
    if at and revision and rev != revision:
        raise CheckpointError(f"{short(raw, 120)} names revision {short(rev, 60)!r} and --revision says "
                              f"{short(revision, 60)!r}: give one")
    rev = (rev if at else revision) or DEFAULT_REVISION
    if not REPO_ID_RE.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise CheckpointError(f"{short(raw, 120)!r} is not a Hugging Face model id: give hf://ORG/NAME[@REVISION] "
                              "(e.g. hf://meta-llama/Llama-3.1-8B-Instruct@main)")
    if not REVISION_RE.match(rev) or ".." in rev:
        raise CheckpointError(f"{short(rev, 80)!r} is not a revision: give a branch, a tag or a 40-character commit")
    return HubRef(repo_id, rev)


# --- reaching the Hub ----------------------------------------------------------------------------


def offline() -> bool:
    """Whether huggingface_hub runs offline in this process (``HF_HUB_OFFLINE``, read when it was imported)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def unreachable_reason(endpoint: str, timeout: float = REACH_TIMEOUT_S) -> str | None:
    """Why the Hub at ``endpoint`` cannot be used from here, in a few words; None when it answers. Any HTTP
    answer counts (a mirror may answer its root with 404); ``HF_HUB_OFFLINE`` set, no connection, or no answer
    within ``timeout`` seconds do not."""
    if offline():
        return "HF_HUB_OFFLINE is set"
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint.rstrip("/") + "/api/whoami-v2",  # noqa: S310
                                                           method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError:  # it answered: reachable, whatever it thinks of an anonymous HEAD
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"no answer from {endpoint} within {timeout:g} s: {short(reason, 120)}"


def _api(access: HubAccess) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=access.endpoint, token=access.hf_token, library_name="quantplan")


def resolve(ref: HubRef, access: HubAccess) -> HubListing:
    """The repository at ``ref``'s revision resolved to its commit, with the files a model needs and their sizes
    (from the repository's file list, nothing downloaded). CheckpointError: offline, unreachable, missing, gated,
    a refused token, an unknown revision (:func:`hub_error`), or no safetensors weights (a ``.bin``-only
    repository is refused here, before any download)."""
    from huggingface_hub.hf_api import RepoFile

    if offline():
        raise CheckpointError(f"{ref.uri}: HF_HUB_OFFLINE is set, so nothing can be fetched from the Hub; unset it "
                              "(or register a folder on shared storage instead)")
    api = _api(access)
    try:
        info = api.model_info(ref.repo_id, revision=ref.revision, timeout=API_TIMEOUT_S)
        commit = str(info.sha or "")
        if not COMMIT_RE.match(commit):
            raise CheckpointError(f"{ref.uri}: the Hub at {access.endpoint} did not say which commit "
                                  f"{ref.revision!r} is (no 40-character sha in its model info)")
        entries = list(api.list_repo_tree(ref.repo_id, revision=commit, recursive=False))
    except CheckpointError:
        raise
    except Exception as exc:
        raise hub_error(exc, ref, access) from exc
    top = {e.path: int(e.size or 0) for e in entries if isinstance(e, RepoFile) and "/" not in e.path}
    try:
        check_weight_files(sorted(top))
    except CheckpointError as exc:
        raise CheckpointError(f"{commit_uri(ref.repo_id, commit)}: {exc}; nothing was downloaded") from None
    files = tuple(HubFile(name, size) for name, size in sorted(top.items())
                  if matches_any(name, HUB_ALLOW_PATTERNS) and not is_pickle(name))
    return HubListing(ref, commit, files, tuple(sorted(n for n in top if n not in {f.name for f in files})))


def check_room(listing: HubListing, *, free_bytes: int, max_bytes: int, present_bytes: int = 0) -> None:
    """Refuse, before the download starts, a repository whose files exceed the artifact store's free space
    (less what an earlier try left, ``present_bytes``) or the size setting ``max_bytes`` (0: no setting); the
    message gives both numbers."""
    weights, total = listing.weight_bytes, listing.total_bytes
    if max_bytes and total > max_bytes:
        raise CheckpointError(f"{listing.ref.uri}: its safetensors weights are {human_size(weights)} "
                              f"({human_size(total)} with config and tokenizer), above the {human_size(max_bytes)} "
                              "limit (QUANTPLAN_HUB_MAX_GIB); raise it to register this model. Nothing was "
                              "downloaded")
    needed = total - present_bytes
    if needed > free_bytes:
        raise CheckpointError(f"{listing.ref.uri}: its files need {human_size(needed)} more but the artifact store "
                              f"has {human_size(free_bytes)} free; free space or move QUANTPLAN_ARTIFACT_DIR. "
                              "Nothing was downloaded")


def present_bytes(listing: HubListing, folder: Path) -> int:
    """Bytes of the listing's files an earlier try already completed in ``folder`` (their size matches)."""
    done = 0
    for f in listing.files:
        path = folder / f.name
        if path.is_file() and path.stat().st_size == f.size:
            done += f.size
    return done


def _byte_bar(on_bytes: Callable[[int], None]) -> type:
    """A tqdm class for snapshot_download's ``tqdm_class`` that draws nothing and tells ``on_bytes`` the bytes
    written so far: the largest count of its byte bars (the bytes written to disk; over plain HTTP the bytes
    received are the same)."""
    from tqdm.auto import tqdm as base_tqdm

    bars: list[Any] = []
    lock = threading.Lock()

    class ByteBar(base_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["disable"] = False  # counted, never drawn: file=None is replaced by a sink below
            kwargs["file"] = _Sink()
            super().__init__(*args, **kwargs)
            if self.unit == "B":
                with lock:
                    bars.append(self)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if self.unit == "B":
                with lock:
                    done = max(int(bar.n) for bar in bars)
                on_bytes(done)
            return shown

    return ByteBar


class _Sink:
    """A file that swallows what a progress bar would draw."""

    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        return None


def fetch_config(listing: HubListing, dest: Path, access: HubAccess) -> Path:
    """Download the repository's ``config.json`` alone into ``dest`` (before any weight) and return its path; the
    full download later keeps it. CheckpointError: no config.json in the repository, or the Hub's failure."""
    from huggingface_hub import hf_hub_download

    if not any(f.name == CONFIG_FILE for f in listing.files):
        raise CheckpointError(f"{listing.source_name}: no {CONFIG_FILE} at the top of the repository: it is not a "
                              "transformers model folder; nothing was downloaded")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        return Path(hf_hub_download(listing.ref.repo_id, CONFIG_FILE, revision=listing.commit, local_dir=dest,
                                    endpoint=access.endpoint, token=access.hf_token, library_name="quantplan"))
    except Exception as exc:
        raise hub_error(exc, listing.ref, access, downloading=True) from exc


def refuse_config(listing: HubListing, dest: Path) -> None:
    """The checks of ``config.json`` an upload goes through (a ``model_type`` transformers ships, no remote code,
    not already quantized: :func:`quantcore.models.validation.check_config` and ``check_model_type``), run on the
    config :func:`fetch_config` fetched, so such a model is refused before its weights are downloaded."""
    try:
        config = check_config(dest)
        check_model_type(str(config["model_type"]))
    except CheckpointError as exc:
        raise CheckpointError(f"{listing.source_name}: {exc}. Its weights were not downloaded") from None


def download(listing: HubListing, dest: Path, access: HubAccess, *,
             on_bytes: Callable[[int], None] | None = None, max_workers: int = 4) -> Path:
    """Download the listing's files at its commit into ``dest`` with ``huggingface_hub.snapshot_download`` and
    return ``dest``. A file a failed try completed is kept and not fetched again; a transfer cut short is resumed
    by huggingface_hub itself (an HTTP Range request from the bytes it has). ``on_bytes`` hears the bytes written
    in this call. CheckpointError saying what failed (:func:`hub_error`)."""
    from huggingface_hub import snapshot_download

    dest.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(listing.ref.repo_id, revision=listing.commit, local_dir=dest, endpoint=access.endpoint,
                          token=access.hf_token, allow_patterns=[glob.escape(f.name) for f in listing.files],
                          max_workers=max_workers, library_name="quantplan",
                          tqdm_class=_byte_bar(on_bytes or (lambda _done: None)))  # never drawn
    except CheckpointError:
        raise
    except Exception as exc:
        if type(exc).__name__ in ("JobCancelled", "JobTimedOut", "Cancelled"):  # the job's own, not the Hub's
            raise
        raise hub_error(exc, listing.ref, access, downloading=True) from exc
    missing = [f.name for f in listing.files if not (dest / f.name).is_file()]
    if missing:
        raise CheckpointError(f"{listing.ref.uri}: the download ended without {', '.join(missing[:3])}: retry the "
                              "job (the files already fetched are kept)")
    return dest


def hub_error(exc: BaseException, ref: HubRef, access: HubAccess, *, downloading: bool = False) -> CheckpointError:
    """The sentence for a huggingface_hub / network failure: offline, missing (or private without a token),
    gated, a refused token, an unknown revision, no network; the Hub's own words otherwise. Never the token."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import OfflineModeIsEnabled

    cause: BaseException | None = exc
    while isinstance(cause, LocalEntryNotFoundError) and cause.__cause__ is not None:  # snapshot_download wraps
        cause = cause.__cause__
    token = "the token in QUANTPLAN_HF_TOKEN" if access.token else "no token (QUANTPLAN_HF_TOKEN is not set)"
    retry = " A retry resumes the download: the files already fetched are kept." if downloading else ""
    uri = ref.uri
    if isinstance(cause, OfflineModeIsEnabled):
        text = f"{uri}: HF_HUB_OFFLINE is set, so nothing can be fetched from the Hub; unset it"
    elif isinstance(cause, GatedRepoError):
        text = (f"{uri} is a gated repository and {token} has no access to it: accept its terms on the Hub with "
                "the account of that token (and set QUANTPLAN_HF_TOKEN to a token of that account)")
    elif isinstance(cause, RevisionNotFoundError):
        text = f"{ref.repo_id} has no revision {ref.revision!r} on the Hub: give a branch, tag or commit it has"
    elif isinstance(cause, RepositoryNotFoundError):
        text = (f"{uri}: no such repository on the Hub at {access.endpoint}, or it is private and "
                + ("the token in QUANTPLAN_HF_TOKEN cannot read it" if access.token
                   else "no token was given: set QUANTPLAN_HF_TOKEN to a token that can read it"))
    elif isinstance(cause, HfHubHTTPError) and cause.response is not None and cause.response.status_code == 401:
        text = (f"{uri}: the Hub refused {token} (401, invalid credentials): set QUANTPLAN_HF_TOKEN to a valid "
                "token")
    elif isinstance(cause, HfHubHTTPError) and cause.response is not None and cause.response.status_code == 403:
        text = f"{uri}: the Hub refused access with {token} (403 forbidden): check the token's permissions"
    elif isinstance(cause, HfHubHTTPError):
        status = cause.response.status_code if cause.response is not None else "?"
        text = f"{uri}: the Hub at {access.endpoint} answered {status}: {short(cause, 200)}.{retry}"
    elif _is_network_error(cause):
        text = (f"{uri}: cannot reach the Hub at {access.endpoint} ({type(cause).__name__}: {short(cause, 160)}): "
                f"check the network, a proxy, or HF_ENDPOINT.{retry}")
    else:
        text = f"{uri}: the download failed ({type(cause).__name__}: {short(cause, 200)}).{retry}"
    return CheckpointError(access.scrub(text))


def _is_network_error(exc: BaseException | None) -> bool:
    """A connection refused, a timeout, a transfer cut short (httpx2's transport errors, or an OSError)."""
    try:
        import httpx2

        if isinstance(exc, httpx2.TransportError):
            return True
    except ImportError:  # pragma: no cover - huggingface_hub always brings it
        pass
    return isinstance(exc, (OSError, TimeoutError, ConnectionError))


class RateMeter:
    """Bytes done of a total, with the time left at the rate seen so far: a progress line for a download."""

    def __init__(self, total: int, start: int = 0) -> None:
        self.total, self.start, self.t0 = total, start, time.monotonic()

    def fraction(self, done: int) -> float:
        return 1.0 if self.total <= 0 else min(1.0, done / self.total)

    def line(self, done: int, what: str) -> str:
        """'downloading WHAT: 1.2 GiB of 16.0 GiB, about 3 min left'."""
        elapsed = time.monotonic() - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        left = ""
        # an estimate once the rate means something: a second in, or a twentieth of the bytes
        if rate > 0 and done < self.total and (elapsed >= 1.0 or done - self.start >= self.total / 20):
            secs = max(1.0, (self.total - done) / rate)
            left = (f", about {secs:.0f} s left" if secs < 90 else f", about {secs / 60:.0f} min left" if secs < 5400
                    else f", about {secs / 3600:.1f} h left")
        return f"downloading {what}: {human_size(done)} of {human_size(self.total)}{left}"
