"""The Results page shows plans that differ only in the outlier fix side by side (issue #46): KL ± error and top-1
of each fix, and each against the plan without a fix, paired over the same sequences."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from streamlit.testing.v1 import AppTest

from quantcore.evaluation.statistics import block_mean
from store import repo
from store.db import session_scope

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
PLAIN = [0.050, 0.080, 0.030, 0.060]  # per-sequence KL of the plan without a fix
ROT = {"kind": "hadamard", "rotations": ["R1", "R2", "R4"], "block_size": 64}


def _score(model_id: int, label: str, body: dict, by_sequence: list[float]) -> int:
    kl = float(np.mean(by_sequence))
    report = {"kl_mean": kl, "kl_p50": kl, "kl_p90": kl, "kl_p99": kl, "kl_max": kl, "top1_agree": 0.9,
              "ppl_ref": 18.0, "ppl": 18.5, "tokens": 4 * 63,
              "kl_mean_err": block_mean(np.array(by_sequence)[:, None]).err,
              "kl_by_sequence": by_sequence, "eval_key": "lee-4x64", "sequences": len(by_sequence),
              "top1_agree_err": 0.01}
    with session_scope() as s:
        job = repo.create_job(s, kind="score", params={}, queue="cpu", user=None, model_id=model_id)
        repo.save_score(s, job_id=job.id, model_id=model_id, plan_id=None, plan_label=label, plan_body=body,
                        dataset="builtin:lee.cor", report=report)
        repo.finish_job(s, job.id, status="succeeded", result={"kl_mean": kl})
        return job.id


def test_plans_that_differ_only_in_the_fix_are_side_by_side(seeded):
    plain = _score(seeded.id, "INT8_W8A8", {"default": "INT8_W8A8"}, PLAIN)
    rotated = _score(seeded.id, "int8-rotated v1", {"model": "tiny-smol", "name": "int8-rotated",
                                                    "default": "INT8_W8A8", "transforms": {"rotation": ROT}},
                     [x - 0.02 for x in PLAIN])  # 0.02 lower on every sequence
    smoothed = _score(seeded.id, "INT8_W8A8_SQ", {"default": "INT8_W8A8_SQ"}, [x - 0.001 for x in PLAIN])
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = seeded.id
    at.run()
    at.switch_page("views/results.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Outlier fixes side by side" in [h.value for h in at.subheader]
    table = next(d.value for d in at.dataframe if "KL − none's" in d.value.columns)
    assert list(table["job"]) == [plain, rotated, smoothed]
    assert list(table["fix"]) == ["none", "rotation R1+R2+R4 (blocks of 64)", "SmoothQuant α=0.5"]
    assert table["KL ± error"].iloc[0].startswith("0.055 ± 0.0")
    value, err = table["KL − none's"].iloc[1].split(" ± ")
    assert value == "-0.02" and float(err) < 1e-12  # paired: the same shift on every sequence, no spread
    assert table["top-1"].iloc[1] == "0.900 ± 0.01"
    assert table["KL − none's"].iloc[0] == ""
