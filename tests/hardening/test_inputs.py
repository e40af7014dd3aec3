"""Malicious and broken inputs: every upload trick, broken checkpoint and hostile plan file is refused with a sentence
that names the file, within bounded time and memory, leaving nothing behind.

Each case runs the real code path (checkpoint registration, plan file reading) in a child process under a memory
limit (``RLIMIT_AS``, :data:`MEMORY_LIMIT`) and a time limit, so a case that would expand a billion-laughs document
or build a 200,000-layer model fails the test instead of taking the machine down. Every registration case also
checks that the models root holds nothing afterwards (no staging leftovers) and that nothing was written beside the
store (an archive member escaping its folder).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.factories import folder_members, make_tar, make_zip, run_cli, save_tiny_llama

REPO = Path(__file__).resolve().parents[2]
MEMORY_LIMIT = 2 * 1024**3  # address space of the child that parses one input (torch + transformers need ~0.7 GB)
CHILD_TIMEOUT = 240  # seconds for a child, imports included; the checks themselves take well under a minute
CHECK_SECONDS = 60  # seconds the registration or parsing itself may take (a tiny model registers in ~1 s)
MAX_BYTES = 64 * 1024 * 1024  # upload limit of these registrations
PRINTED_LIMIT = 2000  # characters a refusal may have: a sentence, never a whole document or path

# The child: limit its memory, run one function of this module, report (ok, error type, message, seconds) as JSON.
DRIVER = textwrap.dedent("""
    import importlib, json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    module, name = sys.argv[1].split(":")
    function = getattr(importlib.import_module(module), name)
    args = json.loads(sys.argv[2])
    start = time.perf_counter()
    try:
        function(*args)
        out = {{"ok": True}}
    except BaseException as exc:
        out = {{"ok": False, "type": type(exc).__name__, "message": str(exc)[:100000]}}
    out["seconds"] = time.perf_counter() - start
    print("RESULT " + json.dumps(out))
""")


def bounded(function: str, *args: object) -> dict:
    """Run ``tests.hardening.test_inputs:<function>(*args)`` in a child under the memory and time limits."""
    code = DRIVER.format(limit=MEMORY_LIMIT)
    try:
        proc = subprocess.run([sys.executable, "-c", code, f"{__name__}:{function}", json.dumps(args)], cwd=REPO,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{function}{args!r} ran past {CHILD_TIMEOUT} s: the input is not bounded in time")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the child died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["seconds"] < CHECK_SECONDS, f"took {result['seconds']:.0f} s"
    return result


# --- what the children run ----------------------------------------------------------------------------------


def register(src: str, root: str) -> None:
    from quantcore.models.intake import register_checkpoint

    register_checkpoint(Path(src), Path(root), max_bytes=MAX_BYTES, cache_dir=Path(root).parent / "cache")


def read_plan(path: str) -> None:
    from quantcore.planning.plans import load_plan_file

    load_plan_file(path)


# --- helpers ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def place(tmp_path: Path) -> Path:
    """A fresh folder holding ``upload/`` (the input) and ``store/models`` (the artifact store's models root)."""
    (tmp_path / "upload").mkdir()
    return tmp_path


def refused(place: Path, src: Path, *needles: str) -> str:
    """Register src in a child; assert it is refused as a CheckpointError whose message names src (or one of
    ``needles``, all of which must appear), a sentence of bounded length; the store holds nothing afterwards and
    nothing was written outside it. Returns the message."""
    root = place / "store" / "models"
    before = sorted(p.relative_to(place) for p in place.rglob("*") if "store" not in p.parts)
    result = bounded("register", str(src), str(root))
    assert not result["ok"], f"{src.name} was registered"
    message = result["message"]
    assert result["type"] == "CheckpointError", f"{result['type']}: {message[:500]}"
    assert len(message) < PRINTED_LIMIT, f"a message of {len(message)} characters"
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    for raw in ("struct.error", "RecursionError", "Traceback", "codec can't decode"):
        assert raw not in message, message
    leftovers = sorted(p.name for p in root.iterdir()) if root.exists() else []
    assert leftovers == [], f"left behind in the store: {leftovers}"
    after = sorted(p.relative_to(place) for p in place.rglob("*") if "store" not in p.parts)
    assert after == before, f"written outside the store: {sorted(set(after) - set(before))}"
    return message


def copy_of(llama_dir: Path, place: Path) -> Path:
    return Path(shutil.copytree(llama_dir, place / "upload" / "model"))


def rewrite_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def rewrite_weights(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = edit(load_file(folder / "model.safetensors"))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


# --- archives -----------------------------------------------------------------------------------------------


def test_a_zip_member_escaping_with_dotdot_is_refused_and_nothing_is_written_outside(llama_dir, place):
    members = {**folder_members(llama_dir), "../../escaped.txt": b"owned"}
    message = refused(place, make_zip(place / "upload" / "slip.zip", members), "'..'")
    assert "escaped.txt" in message and not list(place.rglob("escaped.txt"))


def test_a_tar_member_with_an_absolute_path_is_refused(llama_dir, place):
    target = place / "absolute.txt"
    members = {**folder_members(llama_dir), str(target): b"owned"}
    refused(place, make_tar(place / "upload" / "abs.tar.gz", members), "absolute path")
    assert not target.exists()


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE], ids=["symlink", "hard-link"])
def test_a_tar_with_a_link_is_refused(llama_dir, place, kind):
    link = tarfile.TarInfo("vocab.txt")
    link.type, link.linkname = kind, "/etc/passwd"
    refused(place, make_tar(place / "upload" / "links.tar.gz", folder_members(llama_dir), [link]), "link")


def test_a_zip_with_a_symlink_is_refused(llama_dir, place):
    archive = make_zip(place / "upload" / "links.zip", folder_members(llama_dir))
    with zipfile.ZipFile(archive, "a") as handle:
        link = zipfile.ZipInfo("vocab.txt")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        handle.writestr(link, "/etc/passwd")
    refused(place, archive, "symbolic link")


def test_a_tar_with_a_device_file_is_refused(llama_dir, place):
    device = tarfile.TarInfo("tokenizer.model")
    device.type, device.devmajor, device.devminor = tarfile.CHRTYPE, 1, 3  # /dev/null's numbers
    refused(place, make_tar(place / "upload" / "dev.tar.gz", folder_members(llama_dir), [device]), "special file")


def test_a_zip_bomb_is_refused_from_its_declared_size(llama_dir, place):
    members = {**folder_members(llama_dir), "padding.bin": b"\0" * (MAX_BYTES + 1)}  # ~64 KB compressed
    archive = make_zip(place / "upload" / "bomb.zip", members)
    assert archive.stat().st_size < MAX_BYTES // 100
    refused(place, archive, "would expand to")


def test_a_member_name_of_5000_characters_is_cut_in_the_message(llama_dir, place):
    members = {**folder_members(llama_dir), "a" * 5000 + ".txt": b"x"}
    message = refused(place, make_zip(place / "upload" / "long.zip", members))
    assert "a" * 200 not in message and "long.zip" in message


# --- pickles and remote code --------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".bin", ".pt"])
def test_a_pickle_upload_is_refused_without_being_opened(place, suffix):
    pickle = place / "upload" / f"pytorch_model{suffix}"
    pickle.write_bytes(b"\x80\x04cos\nsystem\n(S'touch /tmp/owned'\ntR.")  # os.system, were it unpickled
    refused(place, pickle, pickle.name, "pickle")


def test_a_folder_whose_weights_are_pickles_only_is_refused(llama_dir, place):
    folder = copy_of(llama_dir, place)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    refused(place, folder, "pytorch_model.bin", "pickle")


def test_a_config_with_auto_map_is_refused_as_remote_code(llama_dir, place):
    folder = copy_of(llama_dir, place)
    rewrite_config(folder, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    refused(place, folder, "remote code", "auto_map")


def test_a_tokenizer_asking_for_remote_code_is_refused(llama_dir, place):
    folder = copy_of(llama_dir, place)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    refused(place, folder, "remote code", "tokenizer_config.json")


# --- safetensors and GGUF -----------------------------------------------------------------------------------


def test_a_truncated_safetensors_file_is_refused(llama_dir, place):
    folder = copy_of(llama_dir, place)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    refused(place, folder, "model.safetensors is truncated")


def test_a_safetensors_header_claiming_more_than_the_file_is_refused(llama_dir, place):
    folder = copy_of(llama_dir, place)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 2**40) + data[8:])  # a header length of 1 TiB
    refused(place, folder, "model.safetensors", "header claims")


def test_a_safetensors_header_lying_about_its_offsets_is_refused(llama_dir, place):
    folder = copy_of(llama_dir, place)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + length])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + 10**12]  # a tensor 1 TB long
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
    refused(place, folder, "model.safetensors is corrupt")


def test_a_bogus_gguf_file_is_refused_with_a_sentence(place):
    bogus = place / "upload" / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + struct.pack("<I", 3) + struct.pack("<QQ", 2**60, 2**60) + b"\xff" * 64)
    refused(place, bogus, "bogus.gguf is not a usable GGUF file")


def test_a_truncated_gguf_file_is_refused_with_a_sentence(place):
    from quantcore.models.intake import demo_gguf_path

    truncated = place / "upload" / "truncated.gguf"
    with demo_gguf_path().open("rb") as handle:
        truncated.write_bytes(handle.read(2_000_000))  # the header and tables whole, the tensor data cut
    refused(place, truncated, "truncated.gguf is not a usable GGUF file", "truncated")


# --- configs ------------------------------------------------------------------------------------------------


def test_a_huge_config_is_refused_before_it_is_parsed(llama_dir, place):
    folder = copy_of(llama_dir, place)
    config = json.loads((folder / "config.json").read_text())
    config["padding"] = "x" * (20 * 1024 * 1024)
    (folder / "config.json").write_text(json.dumps(config))
    refused(place, folder, "config.json is 20.0 MiB")


def test_a_deeply_nested_config_is_refused_with_a_sentence(llama_dir, place):
    folder = copy_of(llama_dir, place)
    text = (folder / "config.json").read_text().rstrip().removesuffix("}")
    (folder / "config.json").write_text(text + ', "nested": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(place, folder, "config.json nests 100,001 levels deep")


def test_a_200000_layer_config_with_one_dummy_tensor_is_refused_at_once(llama_dir, place):
    import torch
    from safetensors.torch import save_file

    folder = copy_of(llama_dir, place)
    rewrite_config(folder, num_hidden_layers=200_000)
    save_file({"foo": torch.zeros(1)}, folder / "model.safetensors")
    archive = make_zip(place / "upload" / "layers.zip", folder_members(folder))
    shutil.rmtree(folder)
    refused(place, archive, "num_hidden_layers: 200,000")


def test_a_config_implying_far_more_parameters_than_the_files_hold_is_refused_with_both_numbers(llama_dir, place):
    folder = copy_of(llama_dir, place)
    rewrite_config(folder, num_hidden_layers=64, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    message = refused(place, folder, "implies at least")
    implied, held = (int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*\d", message)[:2])
    assert implied > 2 * held and "parameters but the safetensors hold" in message


# --- every weight present -----------------------------------------------------------------------------------


def test_a_checkpoint_holding_only_a_foo_tensor_is_refused(llama_dir, place):
    import torch

    folder = copy_of(llama_dir, place)
    rewrite_weights(folder, lambda tensors: {"foo": torch.zeros(4 * 1024 * 1024)})  # as many bytes as it needs
    message = refused(place, folder)
    assert "'foo'" in message or "implies at least" in message


def test_a_checkpoint_with_missing_weights_is_refused_naming_them(llama_dir, place):
    folder = copy_of(llama_dir, place)
    rewrite_weights(folder, lambda tensors: {k: v for k, v in tensors.items() if "layers.1.mlp" not in k})
    refused(place, folder, "model.layers.1.mlp.down_proj.weight", "not in the files")


def test_a_checkpoint_with_an_extra_unused_tensor_is_refused_naming_it(llama_dir, place):
    import torch

    folder = copy_of(llama_dir, place)
    rewrite_weights(folder, lambda tensors: {**tensors, "model.backdoor.weight": torch.zeros(64, 64)})
    refused(place, folder, "model.backdoor.weight", "used by no parameter")


def test_a_rotary_inv_freq_cache_in_the_files_is_ignored(llama_dir, place):
    import torch

    folder = copy_of(llama_dir, place)
    rewrite_weights(folder, lambda t: {**t, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    result = bounded("register", str(folder), str(place / "store" / "models"))
    assert result["ok"], result


# --- plan files ---------------------------------------------------------------------------------------------

# nine nested aliases, eight deep: 9**9 "lol"s once expanded (the anchors sit in rule entries, so a loader that
# expands them and a message that quotes a bad rule print all of them)
BILLION_LAUGHS = "default: FP8\nrules:\n  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"  - &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


def test_a_billion_laughs_plan_file_is_refused_at_once(place):
    plan = place / "upload" / "laughs.yaml"
    plan.write_text(BILLION_LAUGHS)
    assert plan.stat().st_size < 2048
    result = bounded("read_plan", str(plan))
    assert result["type"] == "PlanError" and "laughs.yaml" in result["message"], result
    assert "aliases" in result["message"] and len(result["message"]) < PRINTED_LIMIT


def test_a_binary_plan_file_is_said_to_be_one(place):
    plan = place / "upload" / "plan.yaml"
    plan.write_bytes(b"\xa7\x00\x13GGUF" + os.urandom(256))
    result = bounded("read_plan", str(plan))
    assert result["type"] == "PlanError", result
    assert "plan.yaml" in result["message"] and "is not a text file" in result["message"], result


def test_plan_import_of_a_binary_file_names_it(place, qp_settings, capsys):
    plan = place / "upload" / "binary.yaml"
    plan.write_bytes(b"\xa7\xff\x00" * 100)
    code, _, err = run_cli(capsys, "plan", "import", str(plan), "--model", "anything")
    assert code == 1 and "binary.yaml" in err and "is not a text file" in err and "codec" not in err, err


def test_plan_import_of_a_billion_laughs_file_is_refused_before_anything_expands(place, qp_settings, capsys):
    plan = place / "upload" / "laughs.yaml"
    plan.write_text("model: x\n" + BILLION_LAUGHS)
    code, _, err = run_cli(capsys, "plan", "import", str(plan))
    assert code == 1 and "laughs.yaml" in err and "aliases" in err and len(err) < PRINTED_LIMIT, err
