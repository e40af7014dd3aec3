"""The Results page shows every score with its error and says whether two plans can be told apart (issue #41)."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
SEQUENCES = [0.010, 0.060, 0.020, 0.045, 0.030, 0.080, 0.015, 0.040]  # per-sequence KL: passages differ a lot


def _run(model_id: int) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = model_id
    at.session_state["results_tradeoff_open"] = True  # the cost trade-off, opened (it builds on open)
    at.run()
    at.switch_page("views/results.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _score(model_id: int, label: str, by_sequence: list[float] | None, *, key: str = "lee-8x64") -> int:
    import numpy as np

    from quantcore.evaluation.statistics import block_mean
    from store import repo
    from store.db import session_scope

    kl = float(np.mean(by_sequence)) if by_sequence else 0.04
    report: dict = {"kl_mean": kl, "kl_p50": kl, "kl_p90": kl, "kl_p99": kl, "kl_max": kl, "top1_agree": 0.95,
                    "ppl_ref": 18.0, "ppl": 18.5, "tokens": 8 * 63}
    if by_sequence:
        report.update(kl_mean_err=block_mean(np.array(by_sequence)[:, None]).err, kl_by_sequence=by_sequence,
                      eval_key=key, sequences=len(by_sequence), top1_agree_err=0.01, ln_ppl_ratio=0.027,
                      ln_ppl_ratio_err=0.003, kl_p999=kl * 9, kl_min=0.0)
    with session_scope() as s:
        job = repo.create_job(s, kind="score", params={}, queue="cpu", user=None, model_id=model_id)
        repo.save_score(s, job_id=job.id, model_id=model_id, plan_id=None, plan_label=label,
                        plan_body={"default": label}, dataset="builtin:lee.cor", report=report)
        repo.finish_job(s, job.id, status="succeeded", result={"kl_mean": kl})
        return job.id


def test_results_page_shows_errors_and_whether_two_plans_differ(seeded):
    # two versions of one plan: a constant 0.0003 apart on every sequence (told apart only by pairing), and a
    # plan whose difference is noise; the seeded score was stored before errors were kept
    base = _score(seeded.id, "FP8_DYNAMIC", SEQUENCES)
    shifted = _score(seeded.id, "FP8_DYNAMIC_v2", [x + 0.0003 for x in SEQUENCES])
    noisy = _score(seeded.id, "INT8", [x + d for x, d in zip(SEQUENCES, [3e-3, -4e-3, 2e-3, -1e-3, 0.0, -3e-3,
                                                                          4e-3, -2e-3], strict=True)])
    unerred = _score(seeded.id, "W8A16", None)  # on these tokens, stored without errors
    at = _run(seeded.id)
    table = next(d.value for d in at.dataframe if "KL ± error" in d.value.columns).set_index("job")
    assert table.loc[base, "KL ± error"].startswith("0.0375 ± 0.0")
    old = min(table.index)  # the seeded score: no error stored
    assert table.loc[old, "KL ± error"] == "0.02 ± —" and table.loc[old, "ln(PPL(Q)/PPL(base))"] == "—"

    at.multiselect(key=f"results_compare_{seeded.id}").set_value([shifted, base]).run()
    assert not at.exception
    metrics = [m.value for m in at.metric]
    assert any(v.startswith("KL 0.0378 ± ") for v in metrics) and any(v.startswith("KL 0.0375 ± ") for v in metrics)
    better = [s.value for s in at.success]
    assert any(f"#{base} FP8_DYNAMIC is better by 0.0003 ± " in v and "paired over the same sequences" in v
               for v in better), better
    assert not any("Mean    KLD:" in c.value for c in at.code)  # the statistics are built once their expander opens
    at.session_state["results_statistics_open"] = True  # a click on it (app/views/results.py: STATISTICS_OPEN)
    at.run()
    codes = " ".join(c.value for c in at.code)
    assert "Mean    KLD:" in codes and "Maximum KLD:" in codes and "—" in codes  # Δp: not in these reports

    at.multiselect(key=f"results_compare_{seeded.id}").set_value([noisy, base]).run()
    assert not at.exception
    infos = [i.value for i in at.info]
    assert any(v.startswith("indistinguishable at this sample size: KL ") for v in infos), infos

    at.multiselect(key=f"results_compare_{seeded.id}").set_value([base, unerred]).run()
    infos = [i.value for i in at.info]
    assert any("no verdict: a score was stored before errors were kept" in v for v in infos), infos



def test_a_dearer_plan_whose_kl_cannot_be_told_apart_is_not_on_the_front(seeded):
    """W4A16 and FP8_DYNAMIC differ by noise (FP8's point KL is lower, at more weight memory): the point-estimate
    front keeps both, the front drawn with error bars only the cheaper; BF16's KL 0 is told apart from both."""
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc

    noise = [3e-3, -4e-3, 2e-3, -1e-3, 0.0, -3e-3, 4e-3, -2e-3]
    _score(seeded.id, "FP8_DYNAMIC", SEQUENCES)
    _score(seeded.id, "W4A16", [x - d for x, d in zip(SEQUENCES, noise, strict=True)])
    _score(seeded.id, "BF16", [0.0] * 8)
    model = models_svc.get_model(seeded.id)
    on_set = [s for s in scoring_svc.list_scores(seeded.id) if s.tokens == 8 * 63]
    frame = scoring_svc.tradeoff_frame(model, on_set)
    assert frame.set_index("plan").loc["FP8_DYNAMIC", "kl_mean"] < frame.set_index("plan").loc["W4A16", "kl_mean"]
    point = scoring_svc.with_front(frame.drop(columns="kl_mean_err"), "weight_mib").set_index("plan")["front"]
    assert point.to_dict() == {"BF16": True, "FP8_DYNAMIC": True, "W4A16": True}
    told = scoring_svc.with_front(frame, "weight_mib", on_set).set_index("plan")["front"]
    assert told.to_dict() == {"BF16": True, "FP8_DYNAMIC": False, "W4A16": True}
    at = _run(seeded.id)  # the page's table marks the same front
    table = next(d.value for d in at.dataframe if "front" in d.value.columns).set_index("plan")
    assert not table.loc["FP8_DYNAMIC", "front"] and table.loc["W4A16", "front"]
