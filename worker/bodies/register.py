"""The register job: validate, store (content-addressed) and summarise a checkpoint, then write its model row."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from jobs.specs import RegisterSpec
from store import repo
from worker.runner import JobContext, Outcome


def register(ctx: JobContext) -> Outcome:
    """Register the job's checkpoint (:class:`jobs.specs.RegisterSpec`): the demo, its ``source``, or its ``hub``
    id (:mod:`worker.bodies.register_hub`); a staged
    upload's folder is deleted whatever the outcome. The same content registered twice is one model."""
    from quantcore.models import intake

    asked = RegisterSpec.from_params(ctx.params)
    if asked.hub:
        from worker.bodies.register_hub import register_hub

        return register_hub(ctx, asked)
    staging = Path(asked.cleanup_dir) if asked.cleanup_dir else None
    try:
        src = (intake.demo_gguf_path(asked.demo_model or "smollm2", Path(str(ctx.settings.cache_dir)))
               if asked.demo else Path(str(asked.source)))
        ctx.progress(0.05, f"validating {src.name}")
        sha, folder, summary = intake.register_checkpoint(
            src, ctx.settings.models_dir, max_bytes=ctx.settings.upload_limit_bytes,
            cache_dir=Path(str(ctx.settings.cache_dir)),
        )
    finally:
        if staging is not None:  # an app upload: the staged copy is never needed again
            shutil.rmtree(staging, ignore_errors=True)
    kind = "demo" if asked.demo else ("gguf" if src.suffix == ".gguf" else ("folder" if src.is_dir() else "archive"))
    demo_name = intake.DEMO_MODELS.get(asked.demo_model or "smollm2", repo.DEMO_MODEL_NAME)
    name = asked.name or (demo_name if asked.demo else _default_name(src, summary))
    rel = str(folder.relative_to(Path(str(ctx.settings.artifact_dir))))
    result: dict[str, Any] = {}

    def write(s: Session) -> None:
        known = repo.model_by_sha(s, sha)
        rec = known or repo.add_model(s, name=name, sha256=sha, source_kind=kind,
                                      source_name=asked.source_name or src.name, path=rel,
                                      summary=summary.to_dict(), user=asked.user)
        repo.set_job_model(s, ctx.job_id, rec.id)
        result.update(model_id=rec.id, name=rec.name, linears=len(summary.linears), already=known is not None)
        # the same content registered twice is one model: say so, under the name it has
        outcome.message = (f"already registered as {rec.name} (#{rec.id}): same checkpoint content" if known
                           else f"registered {rec.name}")

    outcome = Outcome(result=result, write=write, message=f"registered {name}")
    return outcome


def _default_name(src: Path, summary: Any) -> str:
    """The file's name without its archive suffix (the architecture where nothing is left)."""
    stem = src.name
    for suffix in (".tar.gz", ".tgz", ".tar", ".zip", ".gguf"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    return stem or summary.architecture
