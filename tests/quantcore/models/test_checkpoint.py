"""Checkpoint intake: registering folders / archives, every refusal, hashing, inspection, loading.

Tiny models are built from configs here (2 layers, hidden 64) and saved with
save_pretrained; no download, no real weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from quantcore.errors import CheckpointError
from quantcore.models.intake import demo_gguf_path, register_checkpoint, safe_extract
from quantcore.models.loading import load_model
from quantcore.models.summary import CheckpointSummary, LinearInfo, inspect_folder
from quantcore.models.validation import (
    PICKLE_SUFFIXES,
    STAGING_PREFIX,
    content_hash,
    read_safetensors_header,
    validate_folder,
)
from tests.factories import (
    TINY_HEADS,
    TINY_HIDDEN,
    TINY_INTERMEDIATE,
    TINY_KV_HEADS,
    TINY_LAYERS,
    WORDS,
    folder_members,
    make_tar,
    make_zip,
    save_tiny_bert,
    save_tiny_llama,
    tiny_tokenizer,
)

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = TINY_HIDDEN, TINY_INTERMEDIATE, TINY_LAYERS, TINY_HEADS, TINY_KV_HEADS
MAX_BYTES = 64 * 1024 * 1024  # generous for the tiny models (~0.3 MB)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture
def src(tmp_path, llama_dir) -> Path:
    """A fresh, writable copy of the tiny Llama folder (tests may break it)."""
    return Path(shutil.copytree(llama_dir, tmp_path / "upload"))


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "models"


def register(source: Path, root: Path, **kwargs):
    options = {"max_bytes": MAX_BYTES, "cache_dir": root.parent / "cache", **kwargs}
    return register_checkpoint(source, root, **options)


def assert_refused(source: Path, root: Path, match: str, **kwargs) -> CheckpointError:
    """Registration fails with a message matching `match` and leaves models_root empty."""
    with pytest.raises(CheckpointError, match=match) as info:
        register(source, root, **kwargs)
    leftovers = sorted(p.name for p in root.iterdir()) if root.exists() else []
    assert leftovers == [], f"left behind in the store: {leftovers}"
    return info.value


# --- registering ---------------------------------------------------------------------------------


def test_register_folder_stores_model_files_and_summarises(src, root):
    (src / "README.md").write_text("about this model")
    (src / "training_args.bin").write_bytes(b"\x80\x04 not really a pickle")
    sha, folder, summary = register(src, root)

    assert len(sha) == 64 and folder == root / sha
    stored = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" in stored and "config.json" in stored and "tokenizer.json" in stored
    assert "README.md" not in stored and not any(name.endswith(PICKLE_SUFFIXES) for name in stored)
    assert sorted(p.name for p in root.iterdir()) == [sha], "no staging folder may remain"
    assert sha == content_hash(folder)

    assert summary.architecture == "LlamaForCausalLM" and summary.model_type == "llama"
    assert summary.num_layers == LAYERS and summary.hidden_size == HIDDEN and summary.vocab_size == len(WORDS) + 3
    assert summary.dtype == "float32"
    shapes = {info.name: (info.in_features, info.out_features) for info in summary.linears}
    head_dim = HIDDEN // HEADS
    assert len(shapes) == LAYERS * 7 + 1
    assert shapes["model.layers.0.self_attn.q_proj"] == (HIDDEN, HIDDEN)
    assert shapes["model.layers.1.self_attn.k_proj"] == (HIDDEN, KV_HEADS * head_dim)
    assert shapes["model.layers.1.mlp.down_proj"] == (INTERMEDIATE, HIDDEN)
    assert shapes["lm_head"] == (HIDDEN, len(WORDS) + 3)
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained(src)
    assert summary.num_params == sum(p.numel() for p in real.parameters())
    assert summary.total_bytes == sum(p.stat().st_size for p in folder.iterdir())


def test_register_is_idempotent(src, root):
    first = register(src, root)
    second = register(src, root)
    assert first[0] == second[0] and first[1] == second[1]
    assert [p.name for p in root.iterdir()] == [first[0]]


def test_archives_register_to_the_same_content_as_the_folder(src, root, tmp_path):
    sha, _, _ = register(src, root)
    zipped = make_zip(tmp_path / "model.zip", folder_members(src, "my-model/"))
    tarred = make_tar(tmp_path / "model.tar.gz", folder_members(src))
    assert register(zipped, root)[0] == sha
    assert register(tarred, root)[0] == sha
    assert [p.name for p in root.iterdir()] == [sha]


def test_sharded_checkpoint_is_registered_and_loads(tmp_path, root):
    from transformers import AutoModelForCausalLM

    source = tmp_path / "sharded"
    save_tiny_llama(source)
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(source, max_shard_size="100KB")
    (source / "model.safetensors").unlink(missing_ok=True)
    shards = sorted(p.name for p in source.glob("model-*.safetensors"))
    assert len(shards) > 1 and (source / "model.safetensors.index.json").is_file()
    _, folder, summary = register(source, root)
    assert sorted(p.name for p in folder.glob("model-*.safetensors")) == shards
    assert summary.num_layers == LAYERS and summary.causal_lm is True
    model, _ = load_model(folder)
    assert model.lm_head.weight.shape == (len(WORDS) + 3, HIDDEN)


def test_encoder_checkpoint_is_registered_and_loaded_as_its_base_model(tmp_path, root):
    source = save_tiny_bert(tmp_path / "bert")
    _, folder, summary = register(source, root)
    assert summary.architecture == "BertModel" and summary.model_type == "bert"
    assert summary.causal_lm is False and summary.to_dict()["causal_lm"] is False
    names = {info.name for info in summary.linears}
    assert "encoder.layer.0.attention.self.query" in names and "encoder.layer.1.output.dense" in names
    model, _ = load_model(folder)
    assert type(model).__name__ == "BertModel"
    # scoring needs next-token logits: a clear refusal, not an index error deep in the KL
    from quantcore.errors import PlanError
    from quantcore.evaluation.batches import forward_logits

    with pytest.raises(PlanError, match="not a causal language model"):
        forward_logits(model, torch.tensor([[1, 2, 3]]))


def test_load_model_reproduces_the_saved_model(src, root):
    from transformers import AutoModelForCausalLM

    _, folder, _ = register(src, root)
    model, tokenizer = load_model(folder)
    assert not model.training and next(model.parameters()).dtype == torch.float32
    ids = tokenizer("the news of the year was said", return_tensors="pt").input_ids
    assert ids.shape[1] == 7 and (ids != tokenizer.unk_token_id).all()
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=0)


def test_summary_round_trips_through_json(src):
    summary = inspect_folder(src)
    restored = CheckpointSummary.from_dict(json.loads(json.dumps(summary.to_dict())))
    assert restored == summary
    assert isinstance(restored.linears[0], LinearInfo)
    # how q/k/v split under tensor parallelism (quantcore.models.parallel)
    assert summary.attention_heads == {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HIDDEN // HEADS}


# --- refusals: nothing may be left behind --------------------------------------------------------


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".pkl", ".ckpt"])
def test_pickle_file_is_refused(tmp_path, root, suffix):
    pickle = tmp_path / f"model{suffix}"
    pickle.write_bytes(b"\x80\x04\x95")
    error = assert_refused(pickle, root, "pickle")
    assert "safetensors" in str(error), "the message must say what to do instead"


def test_folder_with_pickle_weights_only_is_refused(src, root):
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    assert_refused(src, root, "pickle files \\(pytorch_model.bin\\)")


def test_missing_config_is_refused(src, root):
    (src / "config.json").unlink()
    assert_refused(src, root, "no config.json")


def test_invalid_config_json_is_refused(src, root):
    (src / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": 64,,}')
    assert_refused(src, root, "config.json is not valid JSON \\(line 2")


def test_config_without_model_type_is_refused(src, root):
    config = json.loads((src / "config.json").read_text())
    del config["model_type"]
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(src, root, "no \"model_type\"")


def test_config_with_auto_map_is_refused_as_remote_code(src, root):
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(src, root, "needs remote code, which quantplan never runs")


def test_unknown_model_type_is_refused_as_remote_code(src, root):
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "my_private_llm"
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(src, root, "needs remote code.*'my_private_llm' is not built into transformers")


def test_tokenizer_with_auto_map_is_refused(src, root):
    settings_file = src / "tokenizer_config.json"
    tokenizer_config = json.loads(settings_file.read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    settings_file.write_text(json.dumps(tokenizer_config))
    assert_refused(src, root, "tokenizer needs remote code")


def test_prequantized_checkpoint_is_refused(src, root):
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(src, root, "already quantized \\(quant_method 'fp8'\\)")


def test_missing_tokenizer_is_refused(src, root):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    assert_refused(src, root, "no tokenizer")


def test_config_that_does_not_match_the_weights_is_refused(src, root):
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = INTERMEDIATE * 2
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(src, root, "different models")


@pytest.mark.parametrize("cut", [1, 4096, "header"])
def test_truncated_safetensors_is_refused(src, root, cut):
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    keep = 8 + header_len // 2 if cut == "header" else len(data) - cut
    weights.write_bytes(data[:keep])
    assert_refused(src, root, "model.safetensors is truncated")


def test_safetensors_with_garbage_header_is_refused(src, root):
    weights = src / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff\xfe garb"
    weights.write_bytes(bytes(data))
    assert_refused(src, root, "model.safetensors is corrupt")


def test_missing_shard_is_refused(src, root):
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(src, root, "model-00002-of-00002.safetensors, which the upload does not contain")


def test_fake_gguf_is_refused(tmp_path, root):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not gguf at all")
    assert_refused(fake, root, "not a GGUF file")


def test_unknown_file_kind_is_refused(tmp_path, root):
    other = tmp_path / "weights.onnx"
    other.write_bytes(b"\x08\x01")
    assert_refused(other, root, "not a checkpoint quantplan accepts")


@pytest.mark.parametrize("member", ["/etc/config.json", "../config.json", "model/../../config.json",
                                    "C:/model/config.json"])
def test_zip_with_escaping_path_is_refused(src, root, tmp_path, member):
    members = {**folder_members(src), member: b"{}"}
    assert_refused(make_zip(tmp_path / "model.zip", members), root, "absolute path|contains '..'")


def test_tar_with_dotdot_path_is_refused(src, root, tmp_path):
    members = {**folder_members(src), "../evil.txt": b"x"}
    assert_refused(make_tar(tmp_path / "model.tar.gz", members), root, "contains '..'")


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE])
def test_tar_with_link_or_special_file_is_refused(src, root, tmp_path, kind):
    special = tarfile.TarInfo("tokenizer.model")
    special.type = kind
    special.linkname = "/etc/passwd"
    archive = make_tar(tmp_path / "model.tar.gz", folder_members(src), [special])
    assert_refused(archive, root, "link|special file")


def test_zip_with_symlink_is_refused(src, root, tmp_path):
    archive = make_zip(tmp_path / "model.zip", folder_members(src))
    with zipfile.ZipFile(archive, "a") as handle:
        link = zipfile.ZipInfo("vocab.txt")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        handle.writestr(link, "/etc/passwd")
    assert_refused(archive, root, "symbolic link")


@pytest.mark.parametrize("suffix", [".zip", ".tar.gz"])
def test_archive_above_the_size_limit_is_refused(src, root, tmp_path, suffix):
    members = {**folder_members(src), "padding.txt": b"\0" * 4_000_000}  # compresses to almost nothing
    maker = make_zip if suffix == ".zip" else make_tar
    archive = maker(tmp_path / f"model{suffix}", members)
    assert archive.stat().st_size < 1_000_000
    assert_refused(archive, root, "would expand to .* above the 3.8 MiB limit", max_bytes=4_000_000)


def test_folder_above_the_size_limit_is_refused(src, root):
    assert_refused(src, root, "above the", max_bytes=1000)


def test_damaged_archive_is_refused(src, root, tmp_path):
    archive = make_tar(tmp_path / "model.tar.gz", folder_members(src))
    archive.write_bytes(archive.read_bytes()[:2000])
    assert_refused(archive, root, "cannot extract model.tar.gz")


def test_archive_without_config_at_the_top_is_refused(src, root, tmp_path):
    members = {**folder_members(src, "a/b/")}
    assert_refused(make_zip(tmp_path / "model.zip", members), root, "no config.json at the top of the archive")


# --- safe_extract ---------------------------------------------------------------------------------


def test_safe_extract_returns_the_single_top_folder_and_skips_macos_junk(tmp_path):
    members = {"m/config.json": b"{}", "m/vocab.txt": b"a", "__MACOSX/m/._config.json": b"junk"}
    root = safe_extract(make_zip(tmp_path / "x.zip", members), tmp_path / "out", max_bytes=1000)
    assert root == tmp_path / "out" / "m"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m"]


def test_safe_extract_refuses_before_writing_anything(tmp_path):
    members = {"config.json": b"{}", "big.txt": b"\0" * 5000}
    dest = tmp_path / "out"
    with pytest.raises(CheckpointError, match="would expand"):
        safe_extract(make_tar(tmp_path / "x.tar.gz", members), dest, max_bytes=4000)
    assert list(dest.iterdir()) == []


def test_safe_extract_refuses_a_repeated_name(tmp_path):
    archive = tmp_path / "x.zip"
    with zipfile.ZipFile(archive, "w") as handle, pytest.warns(UserWarning, match="Duplicate name"):
        handle.writestr("config.json", b"{}")
        handle.writestr("config.json", b'{"model_type": "evil"}')
    with pytest.raises(CheckpointError, match="twice"):
        safe_extract(archive, tmp_path / "out", max_bytes=1000)


# --- safetensors header check ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_safetensors(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("st") / "w.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(5, dtype=torch.bfloat16),
               "c": torch.zeros(0, 4)}, path)
    return path


def test_safetensors_header_lists_the_tensors(small_safetensors):
    tensors = read_safetensors_header(small_safetensors)
    assert {name: (t.dtype, t.shape) for name, t in tensors.items()} == {
        "a": ("F32", (2, 3)), "b": ("BF16", (5,)), "c": ("F32", (0, 4))}


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(min_value=1, max_value=400))
def test_any_truncation_of_a_safetensors_file_is_detected(small_safetensors, tmp_path_factory, cut):
    data = small_safetensors.read_bytes()
    damaged = tmp_path_factory.mktemp("cut") / "w.safetensors"
    damaged.write_bytes(data[: max(0, len(data) - cut)])
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        read_safetensors_header(damaged)


def test_trailing_bytes_after_a_safetensors_file_are_detected(small_safetensors, tmp_path):
    padded = tmp_path / "w.safetensors"
    padded.write_bytes(small_safetensors.read_bytes() + b"\0" * 8)
    with pytest.raises(CheckpointError, match="trailing bytes"):
        read_safetensors_header(padded)


def test_overlapping_tensors_are_detected(small_safetensors, tmp_path):
    data = small_safetensors.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + header_len])
    header["b"]["data_offsets"] = header["a"]["data_offsets"][:]
    header["b"]["dtype"], header["b"]["shape"] = "F32", [2, 3]
    raw = json.dumps(header).encode()
    broken = tmp_path / "w.safetensors"
    broken.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + header_len:])
    with pytest.raises(CheckpointError, match="corrupt"):
        read_safetensors_header(broken)


# --- hashing, validation, packaging ---------------------------------------------------------------


def test_content_hash_of_a_file_is_its_sha256(small_safetensors):
    assert content_hash(small_safetensors) == hashlib.sha256(small_safetensors.read_bytes()).hexdigest()


def test_content_hash_of_a_folder_sees_names_and_bytes(tmp_path):
    folder = tmp_path / "f"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_bytes(b"one")
    (folder / "sub" / "b.txt").write_bytes(b"two")
    original = content_hash(folder)
    assert content_hash(folder) == original
    (folder / "a.txt").write_bytes(b"onE")
    changed_bytes = content_hash(folder)
    (folder / "a.txt").rename(folder / "c.txt")
    changed_name = content_hash(folder)
    assert len({original, changed_bytes, changed_name}) == 3


def test_validate_folder_returns_the_config(src):
    assert validate_folder(src)["model_type"] == "llama"


def test_no_staging_leftovers_use_the_reserved_prefix(src, root):
    register(src, root)
    assert not any(p.name.startswith(STAGING_PREFIX) for p in root.iterdir())


def test_demo_gguf_is_packaged():
    path = demo_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as handle:
        assert handle.read(4) == b"GGUF"


def test_importing_intake_modules_does_not_import_torch():
    code = ("import sys, quantcore.models.validation, quantcore.models.intake, quantcore.models.summary, "
            "quantcore.models.loading, quantcore.evaluation.text; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "print(', '.join(bad)); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"imported at module level: {result.stdout.strip()} {result.stderr.strip()}"


def test_summary_counts_tied_embeddings_once(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    folder = tmp_path / "tied"
    LlamaForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    summary = inspect_folder(folder)
    untied = sum(int(np.prod(t.shape)) for t in read_safetensors_header(folder / "model.safetensors").values())
    assert summary.num_params == untied  # the file stores the tied matrix once, and so does the count
    assert ("lm_head", 32, 50) in [(i.name, i.in_features, i.out_features) for i in summary.linears]
    assert summary.tied_linears == ["lm_head"]  # quantizing it unties it: the memory figures need to know
    assert CheckpointSummary.from_dict(json.loads(json.dumps(summary.to_dict()))) == summary
    assert CheckpointSummary.from_dict({k: v for k, v in summary.to_dict().items()
                                        if k != "tied_linears"}).tied_linears is None  # an older summary


def test_an_untied_head_is_not_recorded_as_tied(tmp_path):
    from tests.factories import build_tiny_model

    folder = tmp_path / "llama"
    build_tiny_model("llama").save_pretrained(folder)  # tie_word_embeddings=False
    tiny_tokenizer().save_pretrained(folder)
    assert inspect_folder(folder).tied_linears == []


def test_intake_summary_records_sliding_window_layers(tmp_path):
    """A saved Gemma 3 with one sliding layer: the summary names it and its window (the KV cache estimate needs
    it); the Llama demo shape records none."""
    from tests.factories import build_tiny_model

    folder = tmp_path / "gemma"
    build_tiny_model("gemma3").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    summary = inspect_folder(folder)
    assert summary.attention_windows == {"model.layers.0.self_attn": 8}
    assert CheckpointSummary.from_dict(json.loads(json.dumps(summary.to_dict()))) == summary
    assert CheckpointSummary.from_dict({k: v for k, v in summary.to_dict().items()
                                        if k != "attention_windows"}).attention_windows == {}


# --- plausibility: the summary a registration stores stays bounded -------------------------------------------


def test_a_checkpoint_with_more_tensors_than_any_model_is_refused(src, root, monkeypatch):
    from quantcore.models import validation

    monkeypatch.setattr(validation, "MAX_TENSORS", 10)  # the tiny Llama holds 21
    assert_refused(src, root, "more than 10 tensors")


def test_a_model_with_more_linears_than_any_model_is_refused_before_its_summary_is_stored(src, root, monkeypatch):
    from quantcore.models import summary

    monkeypatch.setattr(summary, "MAX_LINEARS", 5)  # the tiny Llama has 15
    assert_refused(src, root, "15 linear layers, more than the 5")


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 200_000), ("hidden_size", 10**6),
                                        ("vocab_size", 10**9), ("num_attention_heads", -1)])
def test_implausible_config_sizes_are_refused_before_any_model_is_built(src, root, key, value):
    config = json.loads((src / "config.json").read_text())
    config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(src, root, f"config.json says {key}: {value:,}")


def test_the_stored_summary_of_the_tiny_model_is_small(src, root):
    _, _, summary = register(src, root)
    assert len(json.dumps(summary.to_dict())) < 4096


def test_loading_refuses_a_stored_checkpoint_whose_weights_went_missing(src, root):
    from safetensors.torch import load_file

    _, folder, _ = register(src, root)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()  # a hard link to the upload's copy may be shared: write a new file
    save_file({k: v for k, v in tensors.items() if "layers.1.self_attn" not in k}, folder / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"not in the files \('model.layers.1.self_attn.k_proj.weight'"):
        load_model(folder)
