"""A local Hugging Face Hub for tests: a real HTTP server speaking the protocol huggingface_hub 2.4 uses.

It serves, for each repository it holds (:class:`HubRepo`): the model info (``GET /api/models/ORG/NAME`` and
``.../revision/REV``, whose ``sha`` is the commit the revision resolves to), the file list (``GET
/api/models/ORG/NAME/tree/REV``), and the files (``HEAD`` / ``GET /ORG/NAME/resolve/REV/FILE``, with
``X-Repo-Commit``, ``ETag`` and ``Content-Length``, and ``Range`` answered with 206). Errors carry the headers
huggingface_hub's ``hf_raise_for_status`` reads: ``X-Error-Code: RepoNotFound`` (404, or 401 for a private
repository without a token that may read it), ``GatedRepo`` (403), ``RevisionNotFound`` (404), ``EntryNotFound``;
a token it does not know is a 401 with ``X-Error-Message: Invalid credentials in Authorization header``.

Faults for the resume tests: ``cut_after[(repo, file)] = n`` ends the next GET of that file after ``n`` bytes
(the connection closed mid-body, once); ``broken`` files answer every GET with 500 until removed. Every request is
recorded (``requests``: method, path, headers) for the tests to assert on (a Range request, a token sent or not).
Point ``HF_ENDPOINT`` (QUANTPLAN's settings) at :attr:`HubServer.url`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


@dataclass
class HubRepo:
    """One repository: its commits (commit -> {file name: bytes}), its refs (branch or tag -> commit), and
    whether it is private (needs a token in ``readers``) or gated (refuses everyone)."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    private: bool = False
    gated: bool = False
    readers: set[str] = field(default_factory=set)

    def add_commit(self, files: dict[str, bytes], *, ref: str = "main") -> str:
        """Store ``files`` as a commit (its id from their bytes), point ``ref`` at it; the commit."""
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + files[name])
        commit = digest.hexdigest()
        self.commits[commit] = dict(files)
        self.refs[ref] = commit
        return commit

    def commit_of(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


def folder_files(folder: Path) -> dict[str, bytes]:
    """The top-level files of a folder (a save_pretrained output) by name."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


class HubServer:
    """The server (started on a free port of 127.0.0.1 in a thread; :meth:`close` stops it)."""

    def __init__(self, port: int = 0) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.tokens: set[str] = set()  # tokens it knows; any other is refused as invalid
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.cut_after: dict[tuple[str, str], int] = {}
        self.broken: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def gets(self, repo_id: str, filename: str) -> list[dict[str, str]]:
        """The headers of every GET of a file."""
        with self.lock:
            return [h for method, path, h in self.requests
                    if method == "GET" and path.startswith(f"/{repo_id}/resolve/") and path.endswith("/" + filename)]


_MODEL_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/(.+))?$")
_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet: the tests read hub.requests
            return None

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        # --- answers -------------------------------------------------------------------------------

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  head: bool = False) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head and body:
                self.wfile.write(body)

        def _json(self, status: int, data: object, head: bool) -> None:
            self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json"}, head)

        def _error(self, status: int, code: str | None, message: str, head: bool) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers, head)

        def _access(self, repo_id: str, head: bool) -> HubRepo | None:
            """The repository when this request may read it; None after answering the refusal."""
            auth = self.headers.get("Authorization") or ""
            token = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
            if token is not None and token not in hub.tokens:
                self._error(401, None, INVALID_CREDENTIALS, head)
                return None
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and token not in repo.readers):
                self._error(404 if repo is None else 401, "RepoNotFound", "Repository not found", head)
                return None
            if repo.gated:
                self._error(403, "GatedRepo", "Access to this model is restricted: you must accept its terms",
                            head)
                return None
            return repo

        def _serve(self, head: bool) -> None:
            path = urlsplit(self.path).path
            with hub.lock:
                hub.requests.append((self.command, unquote(path), {k.title(): v for k, v in self.headers.items()}))
            if m := _TREE.match(path):
                return self._tree(m.group(1), unquote(m.group(2)), head)
            if m := _MODEL_INFO.match(path):
                return self._info(m.group(1), unquote(m.group(2) or "main"), head)
            if m := _RESOLVE.match(path):
                return self._file(m.group(1), unquote(m.group(2)), unquote(m.group(3)), head)
            self._error(404, None, "not a Hub endpoint this test server knows", head)

        def _info(self, repo_id: str, revision: str, head: bool) -> None:
            repo = self._access(repo_id, head)
            if repo is None:
                return
            commit = repo.commit_of(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
            files = repo.commits[commit]
            self._json(200, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.private,
                             "gated": repo.gated, "siblings": [{"rfilename": n} for n in sorted(files)]}, head)

        def _tree(self, repo_id: str, revision: str, head: bool) -> None:
            repo = self._access(repo_id, head)
            if repo is None:
                return
            commit = repo.commit_of(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
            entries = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                       for name, data in sorted(repo.commits[commit].items())]
            self._json(200, entries, head)

        def _file(self, repo_id: str, revision: str, filename: str, head: bool) -> None:
            repo = self._access(repo_id, head)
            if repo is None:
                return
            commit = repo.commit_of(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
            data = repo.commits[commit].get(filename)
            if data is None:
                return self._error(404, "EntryNotFound", f"{filename} does not exist", head)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            if head:
                return self._send(200, b"", {**headers, "Content-Length": str(len(data))}, head=True)
            key = (repo_id, filename)
            if key in hub.broken:
                return self._error(500, None, "the test server broke this file", head=False)
            start = 0
            if m := re.match(r"bytes=(\d+)-", self.headers.get("Range") or ""):
                start = int(m.group(1))
            body = data[start:]
            status = 206 if start else 200
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            with hub.lock:
                cut = hub.cut_after.pop(key, None)
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            if cut is not None:  # a transfer cut short: part of the body, then the connection closes
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


# --- fixtures (a folder's conftest.py imports them: tests/quantcore/models, tests/quantplan/cli, tests/app) ----

TOKEN = "hf_quantplanTestToken0123456789secret"  # the private repository's reader; appears nowhere it should not
WIDE = "test-org/wide-llama"
WIDE_VOCAB = 50_000
PUBLIC, PRIVATE, GATED, BIN_ONLY, MISSING = ("test-org/tiny-llama", "test-org/private-llama", "test-org/gated-llama",
                                             "test-org/bin-only", "test-org/no-such-model")


@pytest.fixture(scope="session")
def hub_checkpoints(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """Files of tiny Llamas saved by save_pretrained (safetensors), made once: seed 0, 1 and 2."""
    from tests.factories import save_tiny_llama

    root = tmp_path_factory.mktemp("hub-checkpoints")
    out = {f"seed{seed}": folder_files(save_tiny_llama(root / f"seed{seed}", seed=seed)) for seed in (0, 1, 2)}
    out["wide"] = folder_files(_save_wide_llama(root / "wide"))
    return out


def _save_wide_llama(folder: Path) -> Path:
    """A 1-layer Llama whose 50,000-token embeddings and head make a ~26 MB safetensors file: larger than
    huggingface_hub's 10 MiB download chunk, so a transfer cut past one chunk resumes from a Range."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.factories import tiny_tokenizer

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=WIDE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def hub(qp_settings, hub_checkpoints, monkeypatch):
    """A local Hub (:class:`HubServer`) that QUANTPLAN's settings point at (HF_ENDPOINT), online in this process,
    holding: PUBLIC (main: seed 0; tag v1: seed 1), PRIVATE (seed 2, read with TOKEN), GATED, BIN_ONLY (config,
    pytorch_model.bin, tokenizer), WIDE (a ~26 MB safetensors file, for the resume tests). QUANTPLAN_HF_TOKEN is
    not set: a test sets it (:func:`set_token`)."""
    import huggingface_hub.constants

    from tests.conftest import clear_settings_cache

    server = HubServer()
    server.tokens.add(TOKEN)
    public = HubRepo()
    public.add_commit(hub_checkpoints["seed1"], ref="v1")
    public.add_commit(hub_checkpoints["seed0"], ref="main")
    private = HubRepo(private=True, readers={TOKEN})
    private.add_commit(hub_checkpoints["seed2"])
    gated = HubRepo(gated=True)
    gated.add_commit(hub_checkpoints["seed0"])
    bin_only = HubRepo()
    seed0 = hub_checkpoints["seed0"]
    bin_only.add_commit({"config.json": seed0["config.json"], "pytorch_model.bin": b"\x80\x02pickle" * 64,
                         "tokenizer.json": seed0["tokenizer.json"]})
    wide = HubRepo()
    wide.add_commit(hub_checkpoints["wide"])
    server.repos.update({PUBLIC: public, PRIVATE: private, GATED: gated, BIN_ONLY: bin_only, WIDE: wide})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.delenv("QUANTPLAN_HF_TOKEN", raising=False)
    # the test session runs huggingface_hub offline (tests/conftest.py sets HF_HUB_OFFLINE before it is imported):
    # this test reaches the local server only, as a process started without HF_HUB_OFFLINE would
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    clear_settings_cache()
    yield server
    server.close()
    clear_settings_cache()


def serve_forever(port: int = 8765) -> None:
    """``python -m tests.hub_server [PORT]``: the same local Hub, held open for trying the command by hand
    (``HF_ENDPOINT=http://127.0.0.1:PORT quantplan models add hf://test-org/tiny-llama@main``)."""
    import tempfile

    from tests.factories import save_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        server = HubServer(port=port)
        server.tokens.add(TOKEN)
        public, private, bin_only = HubRepo(), HubRepo(private=True, readers={TOKEN}), HubRepo()
        seed0 = folder_files(save_tiny_llama(Path(tmp) / "seed0", seed=0))
        public.add_commit(folder_files(save_tiny_llama(Path(tmp) / "seed1", seed=1)), ref="v1")
        public.add_commit(seed0, ref="main")
        private.add_commit(folder_files(save_tiny_llama(Path(tmp) / "seed2", seed=2)))
        bin_only.add_commit({"config.json": seed0["config.json"], "pytorch_model.bin": b"\x80\x02pickle" * 64,
                             "tokenizer.json": seed0["tokenizer.json"]})
        server.repos.update({PUBLIC: public, PRIVATE: private, GATED: HubRepo(gated=True), BIN_ONLY: bin_only})
        server.repos[GATED].add_commit(seed0)
        print(f"local Hub at {server.url}: HF_ENDPOINT={server.url}; repositories {', '.join(server.repos)}; "
              f"{PRIVATE} reads with QUANTPLAN_HF_TOKEN={TOKEN}. Ctrl-C stops it.", flush=True)
        try:
            server.thread.join()
        except KeyboardInterrupt:
            server.close()


def set_token(monkeypatch, token: str | None = TOKEN) -> None:
    """Set (or unset) QUANTPLAN_HF_TOKEN for the settings read next."""
    from tests.conftest import clear_settings_cache

    if token is None:
        monkeypatch.delenv("QUANTPLAN_HF_TOKEN", raising=False)
    else:
        monkeypatch.setenv("QUANTPLAN_HF_TOKEN", token)
    clear_settings_cache()


if __name__ == "__main__":
    import sys

    serve_forever(int(sys.argv[1]) if len(sys.argv) > 1 else 8765)
