"""The register job for a Hugging Face Hub id: resolve, size, download, then validate and store like an upload.

``hub`` (ORG/NAME) at ``revision`` is resolved to its commit first (:func:`quantcore.models.hub.resolve`); a model
already registered from that commit (``hf://ORG/NAME@<commit>``) is the answer, with nothing downloaded. Otherwise
the repository's files are checked against the size setting and the artifact store's free space, downloaded into
``<artifact_dir>/downloads/ORG--NAME@<commit>/`` with progress (bytes of the total, time left), and taken in by
:func:`quantcore.models.intake.register_checkpoint` (the upload's checks: no remote code, every weight present, a
plausible config, intact safetensors), moved rather than copied. The download folder is kept when the Hub or the
network fails, so a retry of the job fetches only what is missing; any refusal of the checkpoint removes it.
``config.json`` is fetched and checked first: a model that needs remote code is refused before its weights are
downloaded.

The token (``QUANTPLAN_HF_TOKEN``) is read from the worker's settings here, handed to huggingface_hub alone, and is
in no parameter, progress message, result, error or log line of the job.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from jobs.specs import RegisterSpec
from store import repo
from store.db import session_scope
from worker.runner import JobContext, Outcome

log = logging.getLogger(__name__)
DOWNLOAD_SHARE = 0.85  # of the progress bar: the download; validating and storing take the rest
DOWNLOADS_SUBDIR = "downloads"


def register_hub(ctx: JobContext, asked: RegisterSpec) -> Outcome:
    """Register ``hf://hub@revision`` of the job's spec (see the module's description); the job's outcome."""
    from quantcore.errors import CheckpointError
    from quantcore.models import hub, intake

    settings = ctx.settings
    access = hub.HubAccess(endpoint=settings.hf_endpoint.rstrip("/"),
                           token=settings.hf_token.get_secret_value() if settings.hf_token else None)
    ref = hub.parse_hub_ref(str(asked.hub), asked.revision)
    ctx.progress(0.01, f"resolving {ref.uri} at {access.endpoint}")
    listing = hub.resolve(ref, access)
    known = _known(ctx, listing.source_name)
    if known is not None:
        return _reuse(ctx, known, listing.source_name)
    dest = Path(str(settings.artifact_dir)) / DOWNLOADS_SUBDIR / f"{ref.repo_id.replace('/', '--')}@{listing.commit}"
    kept = hub.present_bytes(listing, dest)
    store_root = Path(str(settings.artifact_dir))
    store_root.mkdir(parents=True, exist_ok=True)
    hub.check_room(listing, free_bytes=shutil.disk_usage(store_root).free, max_bytes=settings.hub_max_bytes,
                   present_bytes=kept)
    meter = hub.RateMeter(listing.total_bytes, start=kept)
    lock = threading.Lock()
    what = f"{ref.repo_id}@{listing.commit[:12]}"

    def on_bytes(written: int) -> None:  # called from huggingface_hub's download threads
        done = min(listing.total_bytes, kept + written)
        with lock:
            ctx.progress(0.02 + (DOWNLOAD_SHARE - 0.02) * meter.fraction(done), meter.line(done, what))

    ctx.progress(0.02, f"reading the config of {what}")
    hub.fetch_config(listing, dest, access)
    try:
        hub.refuse_config(listing, dest)  # remote code, an unknown model_type, already quantized: before the weights
    except CheckpointError:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    ctx.progress(0.02, meter.line(kept, what) + (" (resuming)" if kept else ""))
    hub.download(listing, dest, access, on_bytes=on_bytes)
    ctx.progress(DOWNLOAD_SHARE, f"validating {what}")
    try:
        sha, folder, summary = intake.register_checkpoint(
            dest, settings.models_dir, max_bytes=settings.hub_max_bytes or max(1, listing.total_bytes),
            cache_dir=Path(str(settings.cache_dir)), move=True)
    except CheckpointError as exc:
        shutil.rmtree(dest, ignore_errors=True)  # refused: nothing of it is kept
        raise CheckpointError(f"{listing.source_name}: {exc}".replace(f"{dest.name}: ", "")) from exc
    shutil.rmtree(dest, ignore_errors=True)  # its files were moved into the store
    name = asked.name or ref.repo_id.rsplit("/", 1)[1]
    rel = str(folder.relative_to(Path(str(settings.artifact_dir))))
    result: dict[str, Any] = {"commit": listing.commit, "source": listing.source_name}

    def write(s: Session) -> None:
        same = repo.model_by_sha(s, sha)
        rec = same or repo.add_model(s, name=name, sha256=sha, source_kind="hub", source_name=listing.source_name,
                                     path=rel, summary=summary.to_dict(), user=asked.user)
        repo.set_job_model(s, ctx.job_id, rec.id)
        result.update(model_id=rec.id, name=rec.name, linears=len(summary.linears), already=same is not None)
        outcome.message = (f"already registered as {rec.name} (#{rec.id}): same checkpoint content" if same
                           else f"registered {rec.name} from {listing.source_name}")

    outcome = Outcome(result=result, write=write, message=f"registered {name}")
    return outcome


def _known(ctx: JobContext, source_name: str) -> Any:
    """The model already registered from this commit, if any (store.records.ModelRecord)."""
    with session_scope(ctx.settings) as s:
        return repo.model_by_source(s, "hub", source_name)


def _reuse(ctx: JobContext, known: Any, source_name: str) -> Outcome:
    """The outcome for a commit already stored: that model, nothing downloaded."""
    result: dict[str, Any] = {"model_id": known.id, "name": known.name, "linears": len(known.linears),
                              "already": True, "commit": source_name.rsplit("@", 1)[1], "source": source_name}

    def write(s: Session) -> None:
        repo.set_job_model(s, ctx.job_id, known.id)

    return Outcome(result=result, write=write,
                   message=f"already registered as {known.name} (#{known.id}) from {source_name}: nothing downloaded")
