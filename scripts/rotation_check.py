"""The Hadamard rotation on a device (scripts/gpu_check.sh's `rotation` step): a tiny Llama with planted outliers,
rotated R1 + R2 + R4 on DEVICE, gives the original logits (max difference printed, exit 1 past 1e-4), and MXFP4 /
INT8 per-tensor activations score KL plain and rotated.

    python scripts/rotation_check.py [cpu|cuda]
"""

from __future__ import annotations

import sys

import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.rotation import rotation_applied
from quantcore.algorithms.rotation_spec import RotationSpec
from quantcore.evaluation.scoring import plan_applied
from tests.factories import build_tiny_model

MAX_LOGIT_DIFF = 1e-4


def main(device: str) -> int:
    model = build_tiny_model("llama").to(device)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0)).to(device)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits.float(), -1)
        with rotation_applied(model, RotationSpec()):
            diff = float((torch.log_softmax(model(ids).logits.float(), -1) - ref).abs().max())
        print(f"rotated logits vs original on {device}: max |difference| of log-probs {diff:.2e}")
        for scheme in ("MXFP4", "INT8_PER_TENSOR"):
            kl = {}
            for label, rot in (("plain", None), ("rotated", RotationSpec())):
                with plan_applied(model, dict.fromkeys(names, scheme), PlanInputs(rotation=rot)):
                    logq = torch.log_softmax(model(ids).logits.float(), -1)
                kl[label] = float((ref.exp() * (ref - logq)).sum(-1).mean())
            print(f"{scheme}: KL plain {kl['plain']:.3g}, rotated {kl['rotated']:.3g}")
    return 0 if diff < MAX_LOGIT_DIFF else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
