"""Run exported recipes with a rotation (SpinQuantModifier) through llm-compressor's ``oneshot`` and write the log-probs
of the model it leaves behind, for quantplan to score against its own reference.

Runs INSIDE .venv-llmc (see scripts/llmc_env.sh), never in quantplan's own environment:

    .venv-llmc/bin/python scripts/llmc_rotate.py MODEL_FOLDER IDS.json JOBS.json

IDS.json is ``{"calibration": [[token ids]], "evaluation": [[token ids]]}`` (rows of one length each), JOBS.json a list
of ``[name, RECIPE.yaml, OUT.safetensors]``. Each job loads the model afresh in float32, runs ``oneshot`` with the
recipe on the calibration rows (in order, one batch), then runs the evaluation rows through the model as ``oneshot``
left it: the rotations folded into its weights, R4 as compressed-tensors' online transform of down_proj's input, and
its quantization applied in the forward (compressed-tensors fake-quantizes weights and activations of a quantized
module until the model is compressed on save). OUT.safetensors holds ``logprobs``: float32 [rows, length, vocab].
A job that raises writes its traceback to OUT.error and the next one goes on; the process exits 1 if any did.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch


def run(folder: str, ids: dict, recipe: str, out: str) -> None:
    import llmcompressor.pipelines.cache as cache
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():  # its cached intermediates pin memory, which torch refuses without a GPU
        cache.IntermediatesCache.pin_memory = lambda self, batch_index: None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    cal = ids["calibration"]
    data = Dataset.from_dict({"input_ids": cal, "attention_mask": [[1] * len(row) for row in cal]})
    oneshot(model=model, processor=tok, recipe=recipe, dataset=data, num_calibration_samples=len(cal),
            max_seq_length=len(cal[0]), shuffle_calibration_samples=False, batch_size=len(cal))
    model.eval()
    rows = torch.tensor(ids["evaluation"], dtype=torch.long)
    with torch.no_grad():
        logp = torch.cat([torch.log_softmax(model(rows[i:i + 4]).logits.float(), dim=-1)
                          for i in range(0, rows.shape[0], 4)])
    save_file({"logprobs": logp.contiguous()}, out)


def main() -> int:
    folder, ids_path, jobs_path = sys.argv[1:4]
    ids = json.loads(Path(ids_path).read_text())
    failed = 0
    for _name, recipe, out in json.loads(Path(jobs_path).read_text()):
        try:
            run(folder, ids, recipe, out)
        except Exception:
            failed += 1
            Path(out).with_suffix(".error").write_text(traceback.format_exc())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
