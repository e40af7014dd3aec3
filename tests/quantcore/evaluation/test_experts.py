"""Expert coverage (issue 43): calibration records how many tokens the router sent to each expert of every MoE block
and the routing weight they got, counted as transformers' own fused experts are called; experts routed too few
tokens are flagged."""

from __future__ import annotations

import torch
from torch import nn

from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.experts import MIN_EXPERT_TOKENS, coverage_rows, expert_coverage_observed, thin_experts
from quantcore.models.moe import split_experts
from tests.factories import tiny_moe


def _fused_routing(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[list[int], list[float]]]:
    """{block: (tokens per expert, routing weight per expert)} from the fused experts' own calls (no split)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    hooks = []
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            def hook(_m, args, name=name):
                index, weights = args[1], args[2]
                n = _m.num_experts if hasattr(_m, "num_experts") else int(index.max()) + 1
                counts = [int((index == e).sum()) for e in range(n)]
                wsum = [float(weights[index == e].double().sum()) for e in range(n)]
                out[name] = (counts, wsum)
            hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return out


def test_calibration_counts_the_tokens_the_router_sends_each_expert():
    fused = tiny_moe(num_experts=16, num_experts_per_tok=2)
    vocab = fused.config.vocab_size
    x = torch.randint(3, vocab, (3, 8), generator=torch.Generator().manual_seed(0))
    expected = _fused_routing(fused, x)
    assert len(expected) == 2
    split_experts(fused)
    with expert_coverage_observed(fused) as coverage:
        calibrate(fused, x, batch_size=2)  # two forwards: the counts add up
    got = coverage.to_dict()
    assert set(got) == set(expected)
    for block, (counts, wsum) in expected.items():
        rec = got[block]
        assert rec["tokens"] == 24 and rec["top_k"] == 2 and sum(rec["counts"]) == 48
        assert rec["counts"] == counts
        assert all(abs(a - b) < 1e-5 for a, b in zip(rec["weight"], wsum, strict=True))
    assert not any(m._forward_pre_hooks for m in fused.modules())  # the observer left nothing behind

    thin = thin_experts(got)
    assert thin == [(b, e, c) for b, r in got.items() for e, c in enumerate(r["counts"]) if c < MIN_EXPERT_TOKENS]
    assert len(thin) == 32  # 48 routed tokens over 16 experts: none reaches 32
    rows = coverage_rows(got, min_tokens=4)
    assert len(rows) == 32 and {r["thin"] for r in rows} == {True, False}
    for r in rows:
        assert r["thin"] == (r["tokens"] < 4)
        assert abs(sum(q["share"] for q in rows if q["block"] == r["block"]) - 1) < 1e-9


def test_a_dense_model_records_no_expert(tiny_llama):
    with expert_coverage_observed(tiny_llama) as coverage:
        calibrate(tiny_llama, torch.randint(0, 128, (1, 8)))
    assert coverage.to_dict() == {} and thin_experts(None) == [] and coverage_rows({}) == []


def test_sensitivity_reports_every_expert_as_its_own_unit_exact_and_estimated():
    """per_expert: one unit per routed expert (its gate/up/down), labelled by the expert, in the exact sweep and the
    Fisher estimate alike (a routed expert's per-row products go back to the positions its tokens came from)."""
    from quantcore.evaluation.fisher import fisher_sensitivity
    from quantcore.evaluation.reference import compute_reference
    from quantcore.evaluation.sensitivity import sensitivity_sweep

    model = tiny_moe(num_experts=4, num_experts_per_tok=2)
    split_experts(model)
    x = torch.randint(3, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(2))
    ref = compute_reference(model, x, batch_size=4)
    whole = sensitivity_sweep(model, "W4A16", x, ref)
    exact = sensitivity_sweep(model, "W4A16", x, ref, per_expert=True)
    est = fisher_sensitivity(model, ["W4A16"], x, ref, per_expert=True, samples=8, passes=4)["W4A16"]
    assert len(exact) == len(whole) + 2 * 3  # each block's one unit became 4
    per_expert = {r.layer: r for r in exact if ".experts." in r.layer}
    assert set(per_expert) == {f"model.layers.{b}.mlp.experts.{e}.{{gate,up,down}}_proj" for b in (0, 1)
                               for e in range(4)}
    assert all(len(r.layers) == 3 for r in per_expert.values())
    got = {r.layer: r for r in est}
    assert set(got) == {r.layer for r in exact}
    for name, row in per_expert.items():
        assert got[name].sqnr_db == row.sqnr_db or abs(got[name].sqnr_db - row.sqnr_db) < 0.05
        assert 0.25 <= got[name].kl_mean / row.kl_mean <= 4.0, (name, got[name].kl_mean, row.kl_mean)
    blocks = {r.layer: r for r in fisher_sensitivity(model, ["W4A16"], x, ref, samples=8, passes=4)["W4A16"]}
    for row in whole:  # a whole block as one unit: its experts' products summed at the positions they came from
        assert 0.5 <= blocks[row.layer].kl_mean / row.kl_mean <= 2.0, (row.layer, blocks[row.layer].kl_mean, row)
