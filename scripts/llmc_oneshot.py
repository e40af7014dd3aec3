"""Run llm-compressor's ``oneshot`` with an exported recipe on a tiny random Llama, and say what came out.

Runs INSIDE .venv-llmc (see scripts/llmc_env.sh), never in quantplan's own environment:

    .venv-llmc/bin/python scripts/llmc_oneshot.py RECIPE.yaml WORKDIR [qwen3_moe]
    .venv-llmc/bin/python scripts/llmc_oneshot.py --batch JOBS.json

``--batch`` runs several in one process (importing llmcompressor takes ~5 s of each run here): JOBS.json is a list
of ``[RECIPE.yaml, WORKDIR, arch]``, run in order, each exactly as on its own (every model and its calibration data
are built from seed 0 again). A run that raises writes its traceback to WORKDIR/oneshot.error and the next one
goes on; the process exits 1 if any did.

With ``qwen3_moe`` the model is a tiny Qwen3-MoE instead (2 blocks, hidden 128, 4 experts of 128 per block, 2 per
token), whose fused experts oneshot splits into one linear per expert (its ``linearize_moe``), saved as
WORKDIR/tiny-moe.

The Llama (3 blocks, hidden 128, MLP 256, GQA 4/2 heads; from a config, nothing downloaded; input channel 3 of the
attention and 5 of the MLP and down_proj's input channel 7 carry outliers, as real LLMs' do) and a word-level
tokenizer are saved to WORKDIR, then ``oneshot`` quantizes it with the recipe on 8 random sequences of 32 tokens
(a recipe with GPTQ, SmoothQuant or static scales needs calibration data). Writes WORKDIR/oneshot.json:
``{"modifiers": [type names], "layers": {linear name: {"weights": args | null, "input_activations": args | null}},
"weights_on_grid": {linear name: bool}, "rounded_to_nearest": {linear name: bool}, "calibration_ids": [[int]]}``
and WORKDIR/oneshot.safetensors: every linear weight as the compressed checkpoint holds it (quantized ones
fake-quantized with the stored scales, NVFP4's ``weight_global_scale`` beside them), every norm weight (AWQ and
SmoothQuant fold into them) and an MoE router's weight (AWQ scales it with the experts); a weight is on its
grid when dividing it by its stored scale gives integers (int formats only; others are left out), and a
quantized weight is rounded to nearest when compressed-tensors' ``fake_quantize`` gives the same of it as of
the weight the model had before ``oneshot``, with the scale ``oneshot`` stored (GPTQ moves weights off that
rounding).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HIDDEN, MLP, BLOCKS, VOCAB = 128, 256, 3, 128


def tiny_llama(workdir: str) -> Path:
    """The tiny Llama with outlier channels, saved to WORKDIR/tiny-llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=BLOCKS,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    folder = Path(workdir) / "tiny-llama"
    tiny = LlamaForCausalLM(cfg)
    with torch.no_grad():  # outlier channels, as real LLMs have: a decisive case for AWQ and SmoothQuant
        for layer in tiny.model.layers:
            layer.input_layernorm.weight[3] = 20.0
            layer.post_attention_layernorm.weight[5] = 15.0
            layer.mlp.up_proj.weight[7] *= 30.0
    tiny.save_pretrained(folder)
    return folder


def tiny_moe(workdir: str) -> Path:
    """A tiny Qwen3-MoE from a config, saved to WORKDIR/tiny-moe (one linear per expert on disk)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, moe_intermediate_size=HIDDEN,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    folder = Path(workdir) / "tiny-moe"
    Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    return folder


def main(recipe: str, workdir: str, arch: str = "llama") -> None:
    import llmcompressor.pipelines.cache as cache
    from datasets import Dataset
    from llmcompressor import oneshot

    if not torch.cuda.is_available():  # its AWQ pins cached inputs, which torch refuses without an accelerator
        cache.IntermediatesCache.pin_memory = lambda self, batch_index: None
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    folder = tiny_moe(workdir) if arch == "qwen3_moe" else tiny_llama(workdir)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                                  unk_token="t0", pad_token="t0")
    tok.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    if arch == "qwen3_moe":  # the names oneshot will give the experts, before taking the weights it starts from
        from llmcompressor.modeling.moe.linearize import linearize_moe

        linearize_moe(model)
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    ids = torch.randint(0, VOCAB, (8, 32))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    oneshot(model=model, processor=tok, recipe=recipe, dataset=data, num_calibration_samples=8, max_seq_length=32)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from llmcompressor.recipe import Recipe

    layers, on_grid, nearest, stored_weights = {}, {}, {}, {}
    for name, module in model.named_modules():
        # AWQ / SmoothQuant fold into the norms; an MoE block's router (mlp.gate) is scaled with its experts' gate/up
        if name.endswith(("norm", "mlp.gate")) and getattr(module, "weight", None) is not None:
            stored_weights[name + ".weight"] = module.weight.detach().float().contiguous()
        if not isinstance(module, torch.nn.Linear):
            continue
        stored_weights[name + ".weight"] = module.weight.detach().float().contiguous()
        scheme = getattr(module, "quantization_scheme", None)
        args = lambda a: None if a is None else a.model_dump(mode="json")  # noqa: E731
        layers[name] = None if scheme is None else {"weights": args(scheme.weights),
                                                    "input_activations": args(scheme.input_activations)}
        if scheme is not None and scheme.weights is not None:
            zero = getattr(module, "weight_zero_point", None)
            # what a compressed checkpoint stores (GPTQ leaves the weight on its grid; a round-to-nearest layer
            # keeps its weight and is rounded when compressed) against rounding the original weight
            gs = getattr(module, "weight_global_scale", None)  # NVFP4's tensor scale (its inverse)
            stored = fake_quantize(module.weight.detach(), module.weight_scale, zero, scheme.weights, global_scale=gs)
            rtn = fake_quantize(before[name], module.weight_scale, zero, scheme.weights, global_scale=gs)
            nearest[name] = bool(torch.equal(rtn, stored))
            stored_weights[name + ".weight"] = stored.float().contiguous()
            if gs is not None:  # NVFP4: 448 · 6 / amax, one per fusion group
                stored_weights[name + ".weight_global_scale"] = gs.detach().float().reshape(1).contiguous()
        if scheme is not None and scheme.weights is not None and scheme.weights.type == "int":
            scale = module.weight_scale.detach().float()
            w = module.weight.detach().float()
            if scale.shape[-1] not in (1, w.shape[-1]):  # groups along K
                scale = scale.repeat_interleave(w.shape[-1] // scale.shape[-1], dim=-1)
            q = w / scale
            on_grid[name] = bool(torch.allclose(q, q.round(), atol=1e-3))
    mods = [type(m).__name__ for m in Recipe.create_instance(recipe).modifiers]
    out = Path(workdir) / "oneshot.json"  # not stdout: llm-compressor logs there
    out.write_text(json.dumps({"modifiers": mods, "layers": layers, "weights_on_grid": on_grid,
                               "rounded_to_nearest": nearest, "calibration_ids": ids.tolist()}))
    from safetensors.torch import save_file

    save_file(stored_weights, str(Path(workdir) / "oneshot.safetensors"))


def batch(jobs_file: str) -> int:
    """Run every ``[recipe, workdir, arch]`` of JOBS.json; 1 if any raised (its traceback in WORKDIR/oneshot.error)."""
    import traceback

    failed = 0
    for recipe, workdir, arch in json.loads(Path(jobs_file).read_text()):
        try:
            main(recipe, workdir, arch)
        except Exception:
            failed += 1
            (Path(workdir) / "oneshot.error").write_text(traceback.format_exc())
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1] == "--batch":
        sys.exit(batch(sys.argv[2]))
    main(*sys.argv[1:4])
