"""History: every run of the team in one table, searched, filtered, sorted and paged; each run opens its own page."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from quantplan.services import history as history_svc
from quantplan.services.errors import Refused
from store.models import JOB_KINDS, JOB_STATUSES

st.title("History")
st.caption("Every run of the team: who ran what, on which model, plan and device, how long it took and what it "
           "found, with the notes and tags people wrote on it. Filter, search, sort; open a run for its page (its "
           "parameters, software, timings, results and the plan's change). `quantplan history` prints the same.")

PAGE = 50  # runs a page
SORT_LABELS = {"id": "run (newest)", "kind": "kind", "status": "status", "model": "model", "plan": "plan",
               "scheme": "scheme", "person": "person", "device": "device", "worker": "worker", "queued": "queued",
               "started": "started", "duration": "duration", "kl": "KL (scores)", "notes": "notes"}
options = history_svc.choices()
asked = st.query_params  # a link may name a filter: /history?person=ann@example.com


def _pick(where, label: str, values: list[str] | tuple[str, ...], key: str) -> str | None:
    """A selectbox of None (any) and ``values``, starting at the one the link names (``?key=...``), if any."""
    param = key.removeprefix("history_")
    if key not in st.session_state and asked.get(param) in values:
        st.session_state[key] = asked.get(param)
    return where.selectbox(label, [None, *values], format_func=lambda v: "any" if v is None else v, key=key)


c1, c2, c3, c4 = st.columns(4)
person = _pick(c1, "Person", options.people, "history_person")
model = _pick(c2, "Model", options.models, "history_model")
plan = _pick(c3, "Plan", options.plans, "history_plan")
kind = _pick(c4, "Kind", JOB_KINDS, "history_kind")
c5, c6, c7, c8 = st.columns(4)
status = _pick(c5, "Status", JOB_STATUSES, "history_status")
device = _pick(c6, "Device", options.devices, "history_device")
tag = _pick(c7, "Tag", options.tags, "history_tag")
days = c8.date_input("Asked for between (UTC days)", value=[], key="history_days", format="YYYY-MM-DD")
c9, c10, c11 = st.columns([3, 1, 1])
if "history_text" not in st.session_state and asked.get("q"):
    st.session_state["history_text"] = asked.get("q")
text = c9.text_input("Search", key="history_text", placeholder="words in the model, plan, person, device, worker, "
                                                                "message, error or notes; #12 for run 12")
sort = c10.selectbox("Sort by", list(SORT_LABELS), format_func=SORT_LABELS.get, key="history_sort")
descending = c11.toggle("Descending", value=True, key="history_descending")

since, until = (list(days) + [None, None])[:2] if isinstance(days, list | tuple) else (days, days)
try:
    wanted = history_svc.history_filter(person=person, model=model, plan=plan, kind=kind, status=status,
                                        device=device, tag=tag, since=since, until=until or since, text=text)
    first = history_svc.history(wanted, sort=sort, descending=descending, page=1, page_size=PAGE)
except Refused as exc:
    st.error(str(exc))
    st.stop()
page_no = 1
if first.pages > 1:
    page_no = int(st.number_input(f"Page (of {first.pages}; {first.total:,} runs, {PAGE} a page)", min_value=1,
                                  max_value=first.pages, value=1, step=1, key="history_page"))
found = first if page_no == 1 else history_svc.history(wanted, sort=sort, descending=descending, page=page_no,
                                                       page_size=PAGE)
if not found.rows:
    st.info("No run yet." if found.total == 0 and wanted == history_svc.HistoryFilter() else "No run matches.")
    st.stop()



def _why(r: history_svc.HistoryRow) -> str:
    """A failed run's error, its first line, where it has no figures."""
    return (r.error or "").splitlines()[0][:120] if r.status == "failed" and r.error else ""


st.caption(f"{found.total:,} run(s) match" + (f"; page {found.page} of {found.pages}" if found.pages > 1 else "")
           + ".")
st.dataframe(pd.DataFrame([{
    "run": f"run?job={r.id}", "kind": r.kind, "status": r.status,
    "model": f"{r.model} (removed)" if r.model and r.model_removed else r.model,
    "plan": f"{r.plan} (chosen)" if r.plan and r.plan_chosen else r.plan, "scheme": r.scheme, "person": r.person,
    "device": r.device, "worker": r.worker, "started": r.started_at or r.queued_at, "duration (s)": r.duration_s,
    "headline": history_svc.headline(r) or _why(r), "notes": " · ".join(r.notes), "tags": " ".join(r.tags),
} for r in found.rows]), hide_index=True, width="stretch", column_config={
    "run": st.column_config.LinkColumn("run", display_text=r"run\?job=(\d+)", help="the run's own page"),
    "started": st.column_config.DatetimeColumn("started", help="when its worker started it (queued, for a run that "
                                                              "never started)"),
    "duration (s)": st.column_config.NumberColumn(format="%.1f", help="from its start to its end"),
    "headline": st.column_config.TextColumn("headline", help="a score's KL ± its standard error and top-1; a "
                                                             "calibration's strongest outlier; a sweep's most "
                                                             "sensitive unit; a benchmark's best speed-up per path"),
})
labels = {r.id: f"#{r.id} {r.kind} · {r.model or '—'} · {r.person or '?'} · {history_svc.headline(r) or r.status}"
          for r in found.rows}
o1, o2 = st.columns([3, 1])
chosen = o1.selectbox("Run", list(labels), format_func=lambda i: labels[i], key="history_open")
with o2:
    st.page_link("views/run.py", label=f"Open run #{chosen}", icon=":material/open_in_new:",
                 query_params={"job": str(chosen)})
