"""Builders of the small things tests share across packages: tiny tokenizers and models (in memory or saved as
Hugging Face folders), tiny MoE models, and Llama-style layer names and plans for the export tests.

Everything is built from config objects with random, seeded weights; nothing is downloaded. Test modules import these
from here, never from one another; fixtures that wrap them live in the conftest.py of the package that uses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import Scheme

if TYPE_CHECKING:
    from torch import nn

# ---------------------------------------------------------------- tiny causal LMs (tests/quantcore/conftest.py)

TINY_ARCHS = ("llama", "qwen2", "gemma3")  # every architecture the fixtures build
TINY_VOCAB = 128  # vocabulary size of every tiny model
TINY_HIDDEN = 64  # hidden size
TINY_INTERMEDIATE = 128  # MLP width (down_proj input width)
TINY_LAYERS = 2  # decoder blocks
TINY_HEADS = 4  # query heads
TINY_KV_HEADS = 2  # key/value heads: GQA with 2 query heads per kv head
TINY_HEAD_DIM = 16  # TINY_HIDDEN // TINY_HEADS
TINY_SEQ = 16  # tokens per sequence in tiny_input_ids
TINY_BATCH = 2  # sequences in tiny_input_ids
OUTLIER_CHANNEL = 3  # hidden channel whose norm gain is raised to plant an activation outlier
OUTLIER_GAIN = 20.0  # its gain: about 20x the other channels, like real LLM outlier features
DOWN_OUTLIER_CHANNEL = 7  # intermediate channel whose up_proj row is scaled up
DOWN_OUTLIER_FACTOR = 30.0  # the scale applied to that row


def build_tiny_model(arch: str, *, seed: int = 0, dtype=None, plant_outliers: bool = True):
    """A fresh tiny causal LM of ``arch`` ("llama" | "qwen2" | "gemma3"), seeded, in eval mode.

    dtype: torch dtype of the parameters (default torch.float32).
    plant_outliers: perturb norm gains (N(0, 0.1) around the neutral gain) and plant the
        outlier channels described in the module docstring.
    """
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_INTERMEDIATE,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(
            **common,
            head_dim=TINY_HEAD_DIM,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {TINY_ARCHS}")

    if plant_outliers:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, module in model.named_modules():
                weight = getattr(module, "weight", None)
                if weight is None or not name.endswith("norm"):
                    continue
                neutral = 0.0 if arch == "gemma3" else 1.0  # Gemma scales by (1 + w)
                noise = 0.1 * torch.randn(weight.shape, generator=gen)
                weight.copy_(neutral + noise)
                if name.endswith(
                    ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")
                ):
                    if not (arch == "gemma3" and name.endswith("post_attention_layernorm")):
                        weight[OUTLIER_CHANNEL] = OUTLIER_GAIN - (1.0 - neutral)
            for layer in model.model.layers:
                layer.mlp.up_proj.weight[DOWN_OUTLIER_CHANNEL] *= DOWN_OUTLIER_FACTOR
    model = model.to(dtype or torch.float32).eval()
    model.requires_grad_(False)
    return model


def linear_input_channel_max(model, input_ids) -> dict:
    """{nn.Linear name: (K,) max |x_j| of its input} over one forward: a minimal calibration for tests."""
    import torch
    from torch import nn

    out: dict = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def hook(mod, args, name=name):
                x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
                out[name] = torch.maximum(out[name], x) if name in out else x

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return out


# ---------------------------------------------------------------- a tokenizer and checkpoints saved to folders

WORDS = "the a of to and in is it that was for on are with as at by this from news said year".split()


def tiny_tokenizer():
    """A word-level fast tokenizer over WORDS, with <unk>, <s> and </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_tiny_llama(folder: Path, *, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 64, GQA 4/2) with random weights and its tokenizer, saved to folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=TINY_HIDDEN, intermediate_size=TINY_INTERMEDIATE,
                         num_hidden_layers=TINY_LAYERS, num_attention_heads=TINY_HEADS,
                         num_key_value_heads=TINY_KV_HEADS,
                         max_position_embeddings=128, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def save_tiny_bert(folder: Path) -> Path:
    """A 2-layer BERT encoder (BertModel) with random weights and its tokenizer."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS) + 3, hidden_size=TINY_HIDDEN, intermediate_size=TINY_INTERMEDIATE,
                        num_hidden_layers=TINY_LAYERS, num_attention_heads=TINY_HEADS, max_position_embeddings=64)
    BertModel(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- tiny mixture-of-experts models

MOE_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=len(WORDS) + 3, tie_word_embeddings=False)

MOE_ARCHS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    # multi-head latent attention, a dense first block and shared experts beside the routed ones
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16),
}


def moe_config(arch: str = "qwen3_moe", **overrides: object) -> object:
    """The transformers config of a tiny MoE model of ``arch`` (a ``model_type``), ``overrides`` applied."""
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, **{**MOE_COMMON, **MOE_ARCHS.get(arch, {}), **overrides})


def tiny_moe(arch: str = "qwen3_moe", *, seed: int = 0, **overrides) -> nn.Module:
    """A 2-layer MoE causal LM with random weights, experts still fused (transformers' own layout)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(moe_config(arch, **overrides)).eval()


def save_tiny_moe(folder: Path, *, seed: int = 0, **overrides) -> Path:
    """A tiny Qwen3-MoE and its tokenizer, saved as a Hugging Face folder (one linear per expert on disk)."""
    tiny_moe(seed=seed, **overrides).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- Llama-style layer names and plans (export tests)

N_BLOCKS = 3


def llama_layer_names(n_blocks: int = N_BLOCKS) -> list[str]:
    """Every nn.Linear of a Llama-style model, in module order (lm_head last)."""
    names = []
    for b in range(n_blocks):
        p = f"model.layers.{b}"
        names += [f"{p}.self_attn.{x}_proj" for x in "qkvo"]
        names += [f"{p}.mlp.{x}_proj" for x in ("gate", "up", "down")]
    return names + ["lm_head"]


LAYERS = llama_layer_names()
#: presets compressed-tensors cannot store (and why they fail is tested below)
INEXPRESSIBLE = {"FP8_E5M2"}
EXPRESSIBLE = [s for s in list_schemes() if s not in INEXPRESSIBLE]


def uniform(scheme: str, *, head: str = "BF16") -> dict[str, Scheme]:
    """``scheme`` on every layer, ``head`` on lm_head; o_proj of a *_SQ scheme gets the unsmoothed preset
    (llm-compressor's SmoothQuant cannot fold o_proj under grouped-query attention)."""
    plan = {n: get_scheme(scheme) for n in LAYERS}
    if "_SQ" in scheme:
        for n in LAYERS:
            if n.endswith("o_proj"):
                plan[n] = get_scheme(scheme.replace("_SQ", ""))
    plan["lm_head"] = get_scheme(head)
    return plan


# ---------------------------------------------------------------- the app's seeded model and the CLI in-process
# (tests/app/conftest.py seeds a deployment with these shapes; tests/quantplan/cli runs the command)

SMOL_HIDDEN, SMOL_KV, SMOL_MLP, SMOL_LAYERS = 576, 192, 1536, 4  # SmolLM2-135M's widths, four blocks of them
SMOL_PROJS = {"self_attn.q_proj": (SMOL_HIDDEN, SMOL_HIDDEN), "self_attn.k_proj": (SMOL_KV, SMOL_HIDDEN),
              "self_attn.v_proj": (SMOL_KV, SMOL_HIDDEN), "self_attn.o_proj": (SMOL_HIDDEN, SMOL_HIDDEN),
              "mlp.gate_proj": (SMOL_MLP, SMOL_HIDDEN), "mlp.up_proj": (SMOL_MLP, SMOL_HIDDEN),
              "mlp.down_proj": (SMOL_HIDDEN, SMOL_MLP)}
OUTLIER_LAYER = "model.layers.2.mlp.down_proj"  # the seeded calibration plants an outlier channel here


def smol_linears() -> list[dict]:
    """The linear layers (name, in_features, out_features) of the seeded model: SMOL_LAYERS blocks, then lm_head."""
    out = [{"name": f"model.layers.{b}.{p}", "in_features": k, "out_features": n}
           for b in range(SMOL_LAYERS) for p, (n, k) in SMOL_PROJS.items()]
    out.append({"name": "lm_head", "in_features": SMOL_HIDDEN, "out_features": 49152})
    return out


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``quantplan ARGV`` in this process: (exit status, stdout, stderr) as captured by ``capsys``."""
    from quantplan.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli_json(capsys, *argv: str):
    """Run ``quantplan ARGV`` (a --json command) and return its parsed output; it must exit 0."""
    import json

    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    return json.loads(out)


# ---------------------------------------------------------------- kernel records and stored models
# (tests/quantcore/kernels, tests/quantcore/planning, tests/store)


def kernel_record(m: int, n: int, k: int, path: str, ms: float | None, name: str = "GPU X"):
    """A quantcore.kernels.records.KernelRecord of one case on CUDA device ``name``: timed in ``ms``, or (``ms`` None)
    skipped "over budget"."""
    from quantcore.kernels.records import KernelRecord

    return KernelRecord(device="cuda", device_name=name, torch_version="t", m=m, n=n, k=k, path=path, ms=ms,
                        tflops=None, pct_peak=None, speedup=None, native=True, max_rel_err=None, padded_m=None,
                        skipped=None if ms is not None else "over budget: test")


def stored_smol_model(s):
    """A model row named "smol" with SmolLM2's linears (:func:`smol_linears`, four blocks counted) and its attention
    heads, in session ``s``: what the automatic plan's service tests plan for."""
    from store import repo

    summary = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 4, "num_params": 10_000_000,
               "dtype": "float32", "total_bytes": 40_000_000, "linears": smol_linears(),
               "attention_heads": {"heads": 9, "kv_heads": 3, "head_dim": 64}}
    return repo.add_model(s, name="smol", sha256="cd" * 32, source_kind="folder", source_name="smol",
                          path="models/smol", summary=summary, user="tester")


def stored_model(s, name: str = "tiny"):
    """A model row (store.repo.add_model) of a tiny two-block Llama with one linear layer, in session ``s``."""
    from store import repo

    return repo.add_model(s, name=name, sha256=name * 4, source_kind="folder", source_name=name, path=f"models/{name}",
                          summary={"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 2,
                                   "num_params": 1000, "dtype": "float32", "total_bytes": 4000,
                                   "linears": [{"name": "a", "in_features": 4, "out_features": 8}]}, user="ann")


# ---------------------------------------------------------------- real processes: a worker, the app (tests/e2e)


class Proc:
    """A process started as a user would start it (``cwd`` the repository, its output to ``log``)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        import subprocess

        self.log = log
        self._fh = open(log, "wb")  # closed by stop()
        self.p = subprocess.Popen(args, env=env, cwd=Path(__file__).resolve().parents[1], stdout=self._fh,
                                  stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float) -> None:
        """Return once ``needle`` is in the log; RuntimeError when the process exits first, TimeoutError after
        ``timeout`` seconds, either with the log's tail."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return
            if self.p.poll() is not None:
                raise RuntimeError(f"process exited ({self.p.returncode}):\n{self.text()[-4000:]}")
            time.sleep(0.3)
        raise TimeoutError(f"no {needle!r} after {timeout} s:\n{self.text()[-4000:]}")

    def stop(self) -> None:
        """Terminate it (killed after 30 s) and close its log."""
        import subprocess

        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self._fh.close()


def start_worker(tmp_path: Path, queues: str = "cpu", name: str | None = None) -> Proc:
    """`quantplan worker --queues QUEUES` in the environment of this test, once it says it is ready; ``name``: its
    node name (``--name NAME@%h``, several workers on this host) and log file ``NAME.log``."""
    import os
    import sys

    extra = ["--name", f"{name}@%h"] if name else []
    proc = Proc([sys.executable, "-m", "quantplan", "worker", "--queues", queues, *extra], dict(os.environ),
                tmp_path / f"{name or 'worker'}.log")
    try:
        proc.wait_for(" ready.", timeout=120)
    except Exception:
        proc.stop()
        raise
    return proc


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- archives of checkpoints (intake and hardening tests)


def folder_members(folder: Path, prefix: str = "") -> dict[str, bytes]:
    """{prefix + file name: bytes} of the files directly in folder: the members of an archive of it."""
    return {prefix + p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def make_zip(path: Path, members: dict[str, bytes]) -> Path:
    """A deflated .zip of ``members`` at path."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def make_tar(path: Path, members: dict[str, bytes], extra: list | tuple = ()) -> Path:
    """A .tar.gz of ``members`` at path, then the ``extra`` TarInfo entries (links, devices) as they are."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for info in extra:
            archive.addfile(info)
    return path
