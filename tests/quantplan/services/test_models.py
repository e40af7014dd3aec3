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
