"""Make the checkpoint llm-compressor's ``oneshot`` really produces from exported recipes, on a real model.

Runs INSIDE .venv-llmc (see scripts/llmc_env.sh), never in quantplan's own environment:

    .venv-llmc/bin/python scripts/llmc_produce.py MODEL_FOLDER CALIBRATION.json JOBS.json

MODEL_FOLDER is a plain safetensors model folder (tests/quantcore/export/test_predicted_produced.py gives it the
SmolLM2-135M conversion quantplan caches), CALIBRATION.json a list of token-id rows, all of one length (quantplan's
own calibration tokens, so that both sides calibrate on the very same ids), JOBS.json a list of
``[name, RECIPE.yaml, OUT_DIR]``. One process runs every job (importing llmcompressor takes several seconds); each
job loads the model afresh in float32 and runs ``oneshot`` with its recipe on those ids (in their order:
``shuffle_calibration_samples=False``; all in one batch, which makes its sequential pipeline one forward a
decoder block instead of one a sequence: the maxima, Hessian sums and SmoothQuant statistics it collects do not
depend on the batching), then writes to OUT_DIR:

* ``produced.safetensors``: the weights the compressed checkpoint implies, decompressed to float32. Every quantized
  linear's weight is fake-quantized with the scales (and zero points, and NVFP4's ``weight_global_scale``) that
  ``oneshot`` stored on the module: compressed-tensors' ``fake_quantize`` with those qparams is what compressing
  the weight and decompressing it again gives (a GPTQ layer's weight is already on its grid; a round-to-nearest
  layer's is rounded here, as compression rounds it). Beside them every norm weight (SmoothQuant folds its factors
  into the norms) and, where a layer has static activation scales, ``NAME.input_global_scale`` (NVFP4's calibrated
  fp32 activation tensor scale, 448 * 6 / amax) or ``NAME.input_scale`` (a static per-tensor scale): what the
  serving engine reads to quantize activations at run time.
* ``produced.json``: ``{"modifiers": [type names], "layers": {linear: {"weights": args | null,
  "input_activations": args | null}}}`` for every linear that got a quantization scheme, so that the caller can
  check the recipe quantized the layers the plan says, as the plan says.

A job that raises writes its traceback to OUT_DIR/produce.error and the next job goes on; the process exits 1 if
any did. llm-compressor logs to stdout and stderr, so nothing is printed for the caller to parse.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch


def produce(folder: str, ids: list[list[int]], recipe: str, out_dir: str) -> None:
    """Run ``oneshot`` with ``recipe`` on the model in ``folder`` calibrated on ``ids``; write OUT_DIR's files."""
    import llmcompressor.pipelines.cache as cache
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.recipe import Recipe
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():  # its cached intermediates pin memory, which torch refuses without a GPU
        cache.IntermediatesCache.pin_memory = lambda self, batch_index: None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]})
    oneshot(model=model, processor=tok, recipe=recipe, dataset=data, num_calibration_samples=len(ids),
            max_seq_length=len(ids[0]), shuffle_calibration_samples=False, batch_size=len(ids))

    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, Any] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("norm") and getattr(module, "weight", None) is not None:
                tensors[name + ".weight"] = module.weight.detach().float().contiguous()
            scheme = getattr(module, "quantization_scheme", None)
            if not isinstance(module, torch.nn.Linear) or scheme is None:
                continue
            dump = lambda a: None if a is None else a.model_dump(mode="json")  # noqa: E731
            layers[name] = {"weights": dump(scheme.weights), "input_activations": dump(scheme.input_activations)}
            if scheme.weights is not None:
                stored = fake_quantize(module.weight.detach(), module.weight_scale,
                                       getattr(module, "weight_zero_point", None), scheme.weights,
                                       global_scale=getattr(module, "weight_global_scale", None))
                tensors[name + ".weight"] = stored.float().contiguous()
            for qparam in ("input_global_scale", "input_scale"):
                value = getattr(module, qparam, None)
                if value is not None:  # registered only for activations with calibrated (static) scales
                    tensors[f"{name}.{qparam}"] = value.detach().float().reshape(-1).contiguous()
    out = Path(out_dir)
    save_file(tensors, str(out / "produced.safetensors"))
    mods = [type(m).__name__ for m in Recipe.create_instance(recipe).modifiers]
    (out / "produced.json").write_text(json.dumps({"modifiers": mods, "layers": layers}))


def main(folder: str, calibration: str, jobs_file: str) -> int:
    """Every job of JOBS.json in turn; 1 if any raised (its traceback in its OUT_DIR/produce.error)."""
    ids = json.loads(Path(calibration).read_text())
    failed = 0
    for _name, recipe, out_dir in json.loads(Path(jobs_file).read_text()):
        try:
            produce(folder, ids, recipe, out_dir)
        except Exception:
            failed += 1
            (Path(out_dir) / "produce.error").write_text(traceback.format_exc())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
