"""What the job bodies share: the device a job runs on, the model it loads, the tokens of the text it reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from store import repo
from store.db import session_scope
from store.records import ModelRecord
from worker.runner import JobContext

_MODEL_CACHE: dict[tuple[str, str], tuple[Any, Any]] = {}  # one model at a time, kept between jobs


def resolve_device(name: str | None) -> str:
    """The device a job asked for (jobs.specs: 'cpu', 'cuda', 'cuda:N'), checked on this worker:
    UnsupportedOnDevice where it has no CUDA for a CUDA job, ValueError for a device no worker has."""
    from quantcore.errors import UnsupportedOnDevice

    device = (name or "cpu").strip()
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UnsupportedOnDevice(
                f"this worker has no CUDA device, so it cannot run a job on {device!r}; "
                "queue it on a GPU worker (queue 'gpu') or choose device 'cpu'"
            )
    elif device != "cpu":
        raise ValueError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    return device


def model_record(ctx: JobContext) -> ModelRecord:
    """The stored model the job points at; ValueError for a job that points at none."""
    if ctx.model_id is None:
        raise ValueError(f"a {ctx.kind} job needs a model, and job #{ctx.job_id} names none")
    with session_scope(ctx.settings) as s:
        return repo.get_model(s, ctx.model_id)


def load_model(ctx: JobContext, model_rec: ModelRecord, device: str) -> tuple[Any, Any]:
    """(model, tokenizer) of the job's model (kept loaded between jobs of the same worker: one model at a time)."""
    from quantcore.models.loading import load_model as qc_load
    from quantcore.models.placement import placement_for

    key = (model_rec.sha256, device)
    if key not in _MODEL_CACHE:
        _MODEL_CACHE.clear()
        ctx.progress(0.01, f"loading {model_rec.name}")
        folder = Path(str(ctx.settings.artifact_dir)) / model_rec.path
        placed = placement_for(folder, device)  # None: on the one device; else over this worker's GPUs
        if placed is not None:
            ctx.progress(0.01, f"loading {model_rec.name} over {len(placed.devices)} GPUs (blocks per GPU: "
                               f"{', '.join(str(len(b)) for b in placed.blocks_on().values())})")
        _MODEL_CACHE[key] = qc_load(folder, device=device, device_map=placed.device_map if placed else None)
        _complete_summary(ctx, model_rec, _MODEL_CACHE[key][0])
    return _MODEL_CACHE[key]


def forget_model() -> None:
    """Drop the model kept between jobs: a score that rounded its weights in place (its last use) leaves nothing
    another job could use; the next job loads the checkpoint again."""
    _MODEL_CACHE.clear()


def _complete_summary(ctx: JobContext, model_rec: ModelRecord, model: Any) -> None:
    """A model registered before its summary kept ``attention_windows`` gets them from the loaded model, so its
    KV cache memory counts sliding windows from its next job on (registering it again would reuse the old row);
    one registered before quantplan split MoE experts gets its expert linears and routing (``moe``) so."""
    summary = model_rec.summary or {}
    fields: dict[str, Any] = {}
    if "attention_windows" not in summary:
        from quantcore.models.summary import attention_windows

        fields["attention_windows"] = attention_windows(model)
    if "moe" not in summary:
        from dataclasses import asdict

        from quantcore.models.moe import moe_summary, unsplit_experts
        from quantcore.models.summary import linear_infos

        fields.update(moe=moe_summary(model, model.config), unsplit_experts=unsplit_experts(model))
        if fields["moe"] is not None:
            fields["linears"] = [asdict(info) for info in linear_infos(model)]
    if fields:
        with session_scope(ctx.settings) as s:
            repo.add_model_summary_fields(s, model_rec.id, fields, replace=("linears",))


def text_path(ctx: JobContext, role: str, dataset: int | str | None) -> tuple[Path, str]:
    """(path, label) of the text a job reads: the stored text ``dataset`` (an id or a name), or with None the
    built-in text of the ``role`` ('calibration' or 'evaluation')."""
    from quantcore.evaluation import text

    if dataset is None:
        path = text.default_calibration_text() if role == "calibration" else text.default_eval_text()
        return path, f"builtin:{path.name}"
    with session_scope(ctx.settings) as s:
        ds = repo.get_dataset(s, dataset)
    path = Path(ds.path)
    if not path.is_absolute():
        path = Path(str(ctx.settings.data_dir)) / path
    return path, ds.name


def token_ids(ctx: JobContext, tokenizer: Any, role: str, *, samples: int, seq_len: int,
              dataset: int | str | None) -> tuple[Any, str]:
    """(token ids [samples, seq_len], the text's label) of the text :func:`text_path` finds."""
    from quantcore.evaluation import text

    path, label = text_path(ctx, role, dataset)
    docs = text.load_documents(path)
    return text.token_batches(tokenizer, docs, n_samples=samples, seq_len=seq_len), label


__all__ = ["load_model", "model_record", "resolve_device", "text_path", "token_ids"]
