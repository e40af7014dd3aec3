"""What the Plans page's plan arithmetic costs on a large mixture-of-experts model, kept against recomputed.

A Plans page render resolves the plan it shows about a dozen times (the layer table, every serving check, the
decode and prefill bounds of the plan and of BF16, the KV cache section) and bounds six steps on the roofline. On
Qwen3-30B-A3B's shapes (48 blocks of 128 routed experts: 18,625 linears, every expert one linear, as intake splits
them) each of those walks every layer, and the page took about 10 s to draw on this 2-core machine. Three things
are kept now, each timed here side by side with the recomputation it replaces, in one run:

- ``quantplan.services.plans.resolve``: the last few resolved plans, keyed by model and plan body (twelve asks: one
  resolve and eleven copies), against twelve full resolves;
- ``quantcore.schemes.fusion.fusion_groups``: the groups of a model's layer names, against grouping them again;
- ``quantcore.kernels.roofline.step_bound``: one bound per distinct (scheme, N, K, routing), against one per layer;
  the two step times must agree exactly, or the script exits 1.

    .venv/bin/python benchmarks/plans_page.py [--repeat 5] [--model qwen3-30b-a3b|smollm2-135m]

Prints the median seconds of each side and their ratio. No database, no model weights: only the shapes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantcore.kernels import roofline  # noqa: E402
from quantcore.schemes import fusion  # noqa: E402
from quantplan.services import models as models_svc  # noqa: E402
from quantplan.services import plans as plans_svc  # noqa: E402
from store.records import ModelRecord  # noqa: E402

RESOLVES_PER_RENDER = 12  # counted on the Plans page (app/views/plans.py) by wrapping every service
BOUNDS_PER_RENDER = 6  # decode and prefill of the plan and of BF16, the cache step, the KV cache section
TARGET = "h100"


def _summary(model: str) -> dict:
    if model == "qwen3-30b-a3b":  # Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 128 experts (top 8) of 768,
        # 32 query heads and 4 KV heads of 128 (q_proj 2048 -> 4096), vocabulary 151,936
        blocks, experts, hidden, inter, vocab = 48, 128, 2048, 768, 151936
        attn = {"q": (4096, hidden), "k": (512, hidden), "v": (512, hidden), "o": (hidden, 4096)}
        mlp = [f"mlp.experts.{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")]
        moe = {"experts": experts, "top_k": 8, "blocks": [f"model.layers.{b}.mlp.experts" for b in range(blocks)]}
    else:  # HuggingFaceTB/SmolLM2-135M: hidden 576, 30 layers, MLP 1536, 9 / 3 heads of 64
        blocks, hidden, inter, vocab = 30, 576, 1536, 49152
        attn = {"q": (576, hidden), "k": (192, hidden), "v": (192, hidden), "o": (hidden, 576)}
        mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        moe = None
    linears = []
    for b in range(blocks):
        linears += [{"name": f"model.layers.{b}.self_attn.{p}_proj", "out_features": n, "in_features": k}
                    for p, (n, k) in attn.items()]
        linears += [{"name": f"model.layers.{b}.{p}", "out_features": hidden if p.endswith("down_proj") else inter,
                     "in_features": inter if p.endswith("down_proj") else hidden} for p in mlp]
    linears.append({"name": "lm_head", "out_features": vocab, "in_features": hidden})
    return {"linears": linears, "moe": moe, "unsplit_experts": []}


def _record(model: str) -> ModelRecord:
    summary = _summary(model)
    return ModelRecord(id=1, name=model, sha256="0" * 64, source_kind="folder", source_name=model, path="-",
                       architecture="-", model_type="-", num_layers=0, num_params=0, dtype="bfloat16",
                       hidden_size=None, vocab_size=None, total_bytes=0, summary=summary,
                       created_at=dt.datetime.now(dt.UTC))


def _per_layer_bound(resolved, shapes, target, m, routed) -> float:
    """The step time as step_bound computed it before: one layer_bound per layer, summed in plan order."""
    return sum(roofline.layer_bound(s, *shapes[n], target, m, routed.get(n)).ms for n, s in resolved.items())


def _median(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="timed repeats of each side (median)")
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=("qwen3-30b-a3b", "smollm2-135m"))
    args = ap.parse_args(argv)

    model = _record(args.model)
    body = {"model": model.name, "default": "FP8_DYNAMIC", "rules": [{"match": "lm_head", "scheme": "BF16"}]}
    names = models_svc.layer_names(model)
    shapes, routed = models_svc.layer_shapes(model), models_svc.routed_layers(model)
    resolved = plans_svc.resolved_or_raise(model, body)

    def kept_resolves() -> None:
        plans_svc._RESOLVED.clear()
        for _ in range(RESOLVES_PER_RENDER):
            plans_svc.resolve(model, body)

    def fresh_resolves() -> None:
        for _ in range(RESOLVES_PER_RENDER):
            plans_svc._resolve(model, body)

    def kept_groups() -> None:
        fusion._fusion_groups.cache_clear()
        for _ in range(RESOLVES_PER_RENDER):
            fusion.fusion_groups(names)

    def fresh_groups() -> None:
        for _ in range(RESOLVES_PER_RENDER):
            fusion._fusion_groups.__wrapped__(tuple(names))

    def deduped_bounds() -> None:
        for _ in range(BOUNDS_PER_RENDER):
            roofline.step_bound(resolved, shapes, TARGET, 1, routed)

    def per_layer_bounds() -> None:
        for _ in range(BOUNDS_PER_RENDER):
            _per_layer_bound(resolved, shapes, TARGET, 1, routed)

    new, old = roofline.step_bound(resolved, shapes, TARGET, 1, routed).ms, _per_layer_bound(
        resolved, shapes, TARGET, 1, routed)
    if new != old:
        print(f"step_bound {new!r} ms differs from the per-layer sum {old!r} ms", file=sys.stderr)
        return 1
    print(f"{args.model}: {len(names):,} linears; one Plans page render = {RESOLVES_PER_RENDER} resolves and "
          f"{BOUNDS_PER_RENDER} step bounds (median of {args.repeat})")
    print(f"{'part':34s} {'kept s':>8s} {'recomputed s':>13s} {'ratio':>7s}")
    for label, kept, fresh in (("resolve the plan", kept_resolves, fresh_resolves),
                               ("fusion groups of the layer names", kept_groups, fresh_groups),
                               ("roofline step bound", deduped_bounds, per_layer_bounds)):
        a, b = _median(kept, args.repeat), _median(fresh, args.repeat)  # side by side, in this order, each run
        print(f"{label:34s} {a:8.3f} {b:13.3f} {b / a:6.1f}x")
    print(f"decode bound at M=1 on {TARGET}: {new:.4f} ms either way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
