"""A seeded embedded deployment for page tests: a model with SmolLM2's linear shapes, calibration
statistics with a planted outlier, a score, a sensitivity sweep and kernel timings (rows only, no
weights: the pages read the database, never a model)."""

from __future__ import annotations

import numpy as np
import pytest

from quantcore.evaluation.stats import HIST_BINS, HIST_BINS_PER_OCTAVE, HIST_LOG2_MIN, LayerStats
from quantcore.kernels.records import TIMING
from store import repo
from store.db import session_scope
from tests.factories import OUTLIER_LAYER, SMOL_LAYERS, smol_linears
from tests.hub_server import hub, hub_checkpoints  # noqa: F401 - the local Hub's fixtures


def fake_stats(rng: np.random.Generator) -> list[LayerStats]:
    stats = []
    for lin in smol_linears():
        k = lin["in_features"]
        cm = rng.lognormal(0.0, 0.5, k).astype(np.float32)
        if lin["name"] == OUTLIER_LAYER:
            cm[7] = float(np.median(cm)) * 3000.0
        hist = np.zeros(HIST_BINS, dtype=np.int64)
        centre = (0 - HIST_LOG2_MIN) * HIST_BINS_PER_OCTAVE
        hist[centre - 20: centre + 10] = rng.integers(10, 1000, 30)
        stats.append(LayerStats(name=lin["name"], in_features=k, out_features=lin["out_features"], n_tokens=256,
                                channel_max=cm, weight_channel_max=rng.lognormal(-3, 0.3, k).astype(np.float32),
                                token_max={"p50": float(np.median(cm)) * 2, "p90": float(cm.max()) * 0.5,
                                           "p99": float(cm.max()) * 0.9, "max": float(cm.max()), "mean": 1.0},
                                hist_counts=hist, zeros=0))
    return stats


@pytest.fixture(autouse=True)
def _fresh_streamlit_caches():
    """Every test has a database of its own, whose job ids start again at 1: the pages' st.cache_data and
    st.cache_resource entries (a calibration's statistics, a chart's spec, keyed by job ids) from an earlier test's
    database must not answer for this one's."""
    import streamlit as st

    st.cache_data.clear()
    st.cache_resource.clear()
    yield


@pytest.fixture
def seeded(qp_settings):
    rng = np.random.default_rng(0)
    summary = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": SMOL_LAYERS,
               "num_params": 10_000_000, "dtype": "float32", "total_bytes": 40_000_000, "linears": smol_linears(),
               "attention_heads": {"heads": 9, "kv_heads": 3, "head_dim": 64}}  # SmolLM2's
    with session_scope(qp_settings) as s:
        model = repo.add_model(s, name="tiny-smol", sha256="ab" * 32, source_kind="folder", source_name="tiny",
                               path="models/x", summary=summary, user="tester")
        cal = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="tester", model_id=model.id)
        repo.mark_running(s, cal.id, worker_host="h", device="cpu", torch_version="t")
        repo.save_activation_stats(s, job_id=cal.id, model_id=model.id, stats=fake_stats(rng))
        repo.finish_job(s, cal.id, status="succeeded", result={"tokens": 256, "text": "builtin:lee_background.cor"})
        sc = repo.create_job(s, kind="score", params={"scheme": "FP8_DYNAMIC"}, queue="cpu", user=None,
                             model_id=model.id)
        edges = list(np.concatenate([[0.0], np.geomspace(1e-6, 10, 41)]))
        repo.save_score(s, job_id=sc.id, model_id=model.id, plan_id=None, plan_label="FP8_DYNAMIC",
                        plan_body={"default": "FP8_DYNAMIC"}, dataset="builtin:lee.cor",
                        report={"kl_mean": 0.02, "kl_p50": 0.01, "kl_p90": 0.05, "kl_p99": 0.2, "kl_max": 1.0,
                                "top1_agree": 0.95, "ppl_ref": 18.0, "ppl": 18.4, "tokens": 1000,
                                "kl_by_position": [{"bucket_start": i * 16, "bucket_end": i * 16 + 16,
                                                    "kl_mean": 0.02 + i * 1e-3} for i in range(8)],
                                "kl_hist": {"edges": edges, "counts": list(range(41))}})
        repo.finish_job(s, sc.id, status="succeeded", result={"kl_mean": 0.02})
        sj = repo.create_job(s, kind="sensitivity", params={"scheme": "INT8_PER_TENSOR"}, queue="cpu", user=None,
                             model_id=model.id)
        repo.save_sensitivity(s, job_id=sj.id, model_id=model.id, scheme="INT8_PER_TENSOR",
                              rows=[{"layer": lin["name"], "layers": [lin["name"]], "kl_mean": float(i) / 100,
                                     "top1_agree": 0.9, "sqnr_db": 20.0} for i, lin in enumerate(smol_linears())])
        repo.finish_job(s, sj.id, status="succeeded", result={"units": len(smol_linears())})
        bj = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user=None)
        recs = []
        for n, k in {(lin["out_features"], lin["in_features"]) for lin in smol_linears()}:
            for m in (1, 16):
                for path in ("baseline", "fp8_tensor", "fp8_row+q", "int8_row"):
                    recs.append(dict(device="cpu", device_name="Test CPU", torch_version="2.13.0", m=m, n=n, k=k,
                                     path=path, ms=1.0 if path == "baseline" else 2.0, tflops=0.01, pct_peak=None,
                                     speedup=1.0 if path == "baseline" else 0.5, native=path == "baseline",
                                     max_rel_err=None if path == "baseline" else 1e-6, padded_m=None,
                                     skipped=None, timing=TIMING))
        repo.save_kernel_results(s, job_id=bj.id, records=recs)
        repo.finish_job(s, bj.id, status="succeeded")
        failed = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None, model_id=model.id)
        repo.finish_job(s, failed.id, status="failed", error="boom: a readable message", traceback="Traceback…")
    return model
