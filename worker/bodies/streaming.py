"""Whole or streamed: which way a job runs its model (quantcore.models.streaming), and the streamed model itself.

A job's ``stream`` parameter decides where given; else the checkpoint's weights (in the job's dtype, from the
safetensors headers) against this worker's budget: ``QUANTPLAN_MODEL_MEMORY_GIB`` where set, else the device's free
memory. A streamed job's scratch folder (``Settings.job_scratch_dir``) is removed when the job ends; the stale-job
sweep removes those of jobs whose worker died (``worker.runner.sweep_scratch``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store.records import ModelRecord
from worker.runner import JobContext


@dataclass(frozen=True)
class Mode:
    """How a job runs its model: ``stream`` or whole, under ``budget`` bytes, for a model of ``weights`` bytes."""

    stream: bool
    budget: int
    weights: int

    @property
    def text(self) -> str:
        from quantcore.models.streaming import gib

        why = f"{gib(self.weights)} of weights, budget {gib(self.budget)}"
        return f"streamed ({why})" if self.stream else f"whole model ({why})"


def model_folder(ctx: JobContext, rec: ModelRecord) -> Path:
    return Path(str(ctx.settings.artifact_dir)) / rec.path


def choose_mode(ctx: JobContext, rec: ModelRecord, asked: bool | None, device: str) -> Mode:
    """Stream or not (module docstring)."""
    from quantcore.models.streaming import checkpoint_bytes, choose_stream, memory_budget

    budget = memory_budget(device, ctx.settings.model_memory_gib)
    weights = checkpoint_bytes(model_folder(ctx, rec), None, device)
    return Mode(choose_stream(asked, weights, budget), budget, weights)


@contextmanager
def streamed_model(ctx: JobContext, rec: ModelRecord, device: str, mode: Mode) -> Iterator[tuple[Any, Any]]:
    """(StreamedModel, tokenizer) of the job's model, its scratch folder removed on exit."""
    from transformers import AutoTokenizer

    from quantcore.models.streaming import StreamedModel

    folder = model_folder(ctx, rec)
    scratch = ctx.settings.job_scratch_dir(ctx.job_id)
    ctx.progress(0.01, f"{rec.name}: {mode.text}")
    try:
        streamed = StreamedModel(folder, device=device, budget=mode.budget, scratch=scratch)
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        yield streamed, tok
        streamed.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def prepared(ctx: JobContext, asked: Any) -> Iterator[tuple[Any, ...]]:
    """The job's (record, model, tokenizer, evaluation ids on its device, text label), and the StreamedModel where the
    job streams (None where it runs whole); the progress says which."""
    from worker.bodies.shared import load_model, model_record, resolve_device, token_ids

    rec = model_record(ctx)
    device = resolve_device(asked.device)
    mode = choose_mode(ctx, rec, asked.stream, device)

    def tokens(tok: Any) -> tuple[Any, str]:
        ids, label = token_ids(ctx, tok, "evaluation", samples=asked.samples, seq_len=asked.seq_len,
                               dataset=asked.dataset)
        return ids.to(device), label

    if mode.stream:
        with streamed_model(ctx, rec, device, mode) as (streamed, tok):
            yield (rec, streamed.model, tok, *tokens(tok), streamed)
        return
    model, tok = load_model(ctx, rec, device)
    ctx.progress(0.02, f"{rec.name}: {mode.text}")
    yield (rec, model, tok, *tokens(tok), None)


def refuse_streamed(what: list[str]) -> None:
    """A streamed job whose plan needs what runs whole-model only: ValueError saying what and how to run it."""
    if what:
        raise ValueError(f"this job runs streamed (block by block), and {', '.join(what)} run whole-model only for "
                         "now: run it with --no-stream (the stream option off) on a worker with room for the whole "
                         "model, or choose a plan without them")


def streamed_reference(streamed: Any, _model: Any, ids: Any, **options: Any) -> Any:
    """compute_reference's call, run on the StreamedModel (quantcore.evaluation.streamed.reference_streamed)."""
    from quantcore.evaluation.streamed import reference_streamed

    return reference_streamed(streamed, ids, **options)


def streamed_kv_amax(streamed: Any, _model: Any, plan: Any, ids: Any, **options: Any) -> Any:
    """calibrate_kv_cache's call, run on the StreamedModel (quantcore.evaluation.streamed)."""
    from quantcore.evaluation.streamed import calibrate_kv_cache_streamed

    return calibrate_kv_cache_streamed(streamed, plan, ids, **options)


__all__ = ["Mode", "choose_mode", "prepared", "refuse_streamed", "streamed_kv_amax", "streamed_model",
           "streamed_reference"]
