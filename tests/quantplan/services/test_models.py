"""Registering models (quantplan.services.models): the uploads and paths refused before any job, with what to do
instead, and the ones queued for a worker."""

from __future__ import annotations

from quantplan.services import jobs as jobs_svc
from quantplan.services import models as models_svc


def test_uploads_and_paths_the_app_refuses_before_any_job(qp_settings, monkeypatch, tmp_path) -> None:
    """A pickle checkpoint, a file of no upload kind, an upload over the limit, a relative or missing path: each
    refused with what to do instead, nothing queued or staged. A folder that exists is queued for a worker."""
    import pytest

    from store.settings import get_settings

    for name in ("pytorch_model.bin", "model.pt", "ckpt.pth", "weights.pkl"):
        with pytest.raises(ValueError, match=f"{name} is a pickle checkpoint; quantplan never unpickles uploads. "
                                             r"Save the model with save_pretrained\(safe_serialization=True\)"):
            models_svc.register_upload(name, b"\x80\x04")
    with pytest.raises(ValueError, match=r"model.safetensors: upload a .zip or .tar.gz of a Hugging Face folder"):
        models_svc.register_upload("model.safetensors", b"{}")
    with pytest.raises(ValueError, match="give an absolute path"):
        models_svc.register_path("models/llama")
    with pytest.raises(ValueError, match="does not exist"):
        models_svc.register_path(str(tmp_path / "nowhere"))
    monkeypatch.setenv("QUANTPLAN_UPLOAD_LIMIT_MB", "1")
    get_settings.cache_clear()
    with pytest.raises(ValueError, match=r"big.zip is 2 MiB, over the 1 MiB limit"):
        models_svc.register_upload("big.zip", b"PK\x03\x04" + bytes(2 * 1024 * 1024))
    assert jobs_svc.list_jobs() == []
    uploads = qp_settings.artifact_dir / "uploads"
    assert not uploads.exists() or not any(uploads.iterdir())
    (tmp_path / "folder").mkdir()
    job = models_svc.register_path(str(tmp_path / "folder"), name="mine")
    assert (job.kind, job.params["source"], job.params["name"]) == ("register", str(tmp_path / "folder"), "mine")


def test_an_upload_whose_bytes_are_not_what_its_name_says_is_refused_at_once(qp_settings) -> None:
    import io
    import tarfile
    import zipfile

    import pytest

    noise = bytes(range(256)) * 8
    for name, kind in (("model.zip", "zip archive"), ("model.tar.gz", "tar archive"), ("model.tgz", "tar archive"),
                       ("model.tar", "tar archive"), ("model.gguf", "GGUF file")):
        with pytest.raises(ValueError, match=f"model.* is not a {kind} .*nothing was queued"):
            models_svc.register_upload(name, noise)
    assert jobs_svc.list_jobs() == []  # nothing queued, nothing staged
    uploads = qp_settings.artifact_dir / "uploads"
    assert not uploads.exists() or not any(uploads.iterdir())
    # real archives pass the check (the worker validates their contents)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("config.json", "{}")
    assert models_svc._upload_kind_mismatch("m.zip", buf.getvalue()) is None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("config.json")
        info.size = 2
        t.addfile(info, io.BytesIO(b"{}"))
    assert models_svc._upload_kind_mismatch("m.tar.gz", buf.getvalue()) is None
    assert models_svc._upload_kind_mismatch("m.gguf", b"GGUF\x03\x00\x00\x00") is None


def test_a_model_listing_reads_no_per_layer_summary(qp_settings) -> None:
    """A listing of every model reads each row's overview, never its summary (which lists every linear layer and
    can run to megabytes): a model registered with 20,000 linears is listed with the right counts, and once its
    overview is kept no statement of a listing names the summary column. A model whose summary changes (a later
    quantplan adds fields) is listed anew from it."""
    from sqlalchemy import event

    from store import repo
    from store.db import get_engine, session_scope

    linears = [{"name": f"model.layers.{i}.mlp.experts.{e}.{p}", "in_features": 64, "out_features": 128}
               for i in range(100) for e in range(50) for p in ("gate_proj", "up_proj", "down_proj", "x")]
    big = {"architecture": "MixtralForCausalLM", "model_type": "mixtral", "num_layers": 100,
           "num_params": 10**9, "dtype": "bfloat16", "total_bytes": 2 * 10**9, "linears": linears,
           "moe": {"experts": 50, "top_k": 2}, "attention_windows": {"model.layers.0.self_attn": 4096}}
    with session_scope(qp_settings) as s:
        small = repo.add_model(s, name="small", sha256="a" * 64, source_kind="folder", source_name="small",
                               path="models/small", summary={"architecture": "LlamaForCausalLM",
                               "model_type": "llama", "num_layers": 2, "num_params": 1000, "dtype": "float32",
                               "total_bytes": 4000, "linears": linears[:3]}, user="ann")
        huge = repo.add_model(s, name="huge", sha256="b" * 64, source_kind="folder", source_name="huge",
                              path="models/huge", summary=big, user="ann")
    statements: list[str] = []

    def seen(conn, cursor, statement, *args) -> None:
        statements.append(statement)

    engine = get_engine(qp_settings)
    event.listen(engine, "before_cursor_execute", seen)
    try:
        first = {m.name: m for m in models_svc.list_models()}  # writes the overviews: reads each summary once
        assert first["huge"].overview == models_svc.overview(huge)
        assert first["huge"].overview["linears"] == 20000 and first["small"].overview["linears"] == 3
        assert first["huge"].overview["experts"] == 50 and first["huge"].overview["sliding_window_layers"] == 1
        assert first["small"].overview == models_svc.overview(small)
        statements.clear()
        again = models_svc.list_models()
        assert [m.overview for m in again] == [first["small"].overview, first["huge"].overview]
        assert statements and not any("summary" in st for st in statements), statements
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    with session_scope(qp_settings) as s:  # a later quantplan summarises more: the overview follows the summary
        repo.add_model_summary_fields(s, small.id, {"linears": linears[:7]}, replace=("linears",))
    assert {m.name: m for m in models_svc.list_models()}["small"].overview["linears"] == 7
