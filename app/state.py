"""Shared sidebar and session state: the model every page works on."""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable, Hashable
from typing import Any

import pandas as pd
import streamlit as st

from app.charts.base import vega_spec
from quantplan.services import deployment as deployment_svc
from quantplan.services import jobs as jobs_svc
from quantplan.services import models as models_svc
from quantplan.services import workers as workers_svc
from store.records import ModelRecord

MODEL_KEY = "model_id"
WIDGET_KEY = "sidebar_model"  # the sidebar's model selectbox
URL_MODEL = "model"  # query parameter: /kernels?model=3


def sidebar() -> None:
    """The sidebar every page shares: the model chosen (kept in the session and the address), jobs waiting; the
    page stops with the fix where the database is not ready."""
    freeze_imported()
    problem = _schema_problem()
    if problem:
        st.error(problem)
        st.stop()
    models = models_svc.list_models()
    with st.sidebar:
        st.markdown("### quantplan")
        if not models:
            st.caption("No model registered yet: start on the Models page.")
            st.session_state.pop(MODEL_KEY, None)
            return
        ids = [m.id for m in models]
        names = {m.id: f"#{m.id} {m.name}" for m in models}
        current = _model_from_url(ids)
        if current is not None and current != st.session_state.get(MODEL_KEY):
            st.session_state.pop(WIDGET_KEY, None)  # a link to another model wins over the widget's memory
        else:
            current = st.session_state.get(MODEL_KEY)
        index = ids.index(current) if current in ids else len(ids) - 1
        # the widget still holds a model that was removed (here or by a colleague): give it the model the
        # page will use through Session State, which the browser's widget follows (a default index would
        # leave it showing the removed one)
        stale = st.session_state.get(WIDGET_KEY) not in (None, *ids)
        if stale:
            st.session_state[WIDGET_KEY] = ids[index]
        chosen = st.selectbox("Model", ids, **({} if stale else {"index": index}), format_func=names.get,
                              key=WIDGET_KEY)
        st.session_state[MODEL_KEY] = chosen
        st.query_params[URL_MODEL] = str(chosen)  # the address names the model: links can be shared
        active = jobs_svc.list_jobs(limit=50, status=ACTIVE_STATUSES)  # an indexed filter: no finished job's result
        if active:
            st.caption(f"{len(active)} job(s) queued or running: see Jobs.")
            orphans = workers_svc.idle_queues(j.queue for j in active if j.status == "queued")
            if orphans:
                st.warning(f"No live worker consumes queue {', '.join(repr(q) for q in orphans)}: "
                           "those jobs wait. See Jobs.")


_frozen_at = 0  # len(sys.modules) when the heap was last frozen


def freeze_imported() -> None:
    """Move what this process holds now into the collector's permanent generation (``gc.freeze``) whenever modules
    were imported since the last time: Streamlit collects every generation after each run, fragments' included
    (``runner.postScriptGC``), and that full collection walked every object of torch, pandas, Altair and the rest the
    pages import (about 60 % of the server's CPU of an α step on Outliers, py-spy). A full collection first, so that
    only what is alive is frozen (as a run starts after new imports: the first visits of the pages). The modules stay
    for the process's life; the few session objects frozen with them are then freed by reference counting alone (a
    cycle among them stays)."""
    global _frozen_at
    if len(sys.modules) != _frozen_at:
        gc.collect()
        gc.freeze()
        _frozen_at = len(sys.modules)


ACTIVE_STATUSES = ("queued", "running")
SCHEMA_RECHECK_S = 30.0  # a database found current is checked again after this long (every run took 10-40 ms)
_schema_ok: dict[str, float] = {}  # database URL -> when it was last found current (time.monotonic)


def _schema_problem() -> str | None:
    """deployment_svc.schema_problem(), its "ready" remembered per database for SCHEMA_RECHECK_S: a migrated database
    stays at the newest revision (only `quantplan migrate` moves it, forward), and the check reads the migrations'
    folder and opens the database on every run of every page. A problem is never remembered: it shows until fixed."""
    url = str(deployment_svc.settings().database_url)
    if time.monotonic() - _schema_ok.get(url, -math.inf) < SCHEMA_RECHECK_S:
        return None
    problem = deployment_svc.schema_problem()
    if problem is None:
        _schema_ok[url] = time.monotonic()
    return problem


def _model_from_url(ids: list[int]) -> int | None:
    """The model id in the address (``?model=3``), when it names a registered model."""
    raw = st.query_params.get(URL_MODEL)
    try:
        value = int(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value in ids else None


def current_model() -> ModelRecord | None:
    """The model chosen in the sidebar, or None (with a hint shown) when there is none."""
    model_id = st.session_state.get(MODEL_KEY)
    if model_id is None:
        st.info("Register a model on the Models page first (the demo model is one click).")
        return None
    try:
        return models_svc.get_model(model_id)
    except LookupError:  # removed since (by this session or a colleague's)
        st.session_state.pop(MODEL_KEY, None)
        st.info(f"Model #{model_id} was removed: choose another in the sidebar, or register one on the Models page.")
        return None


PLAN_SAVED = "plan_saved"  # (what was said, plan name) of a plan saved or imported, for the Plans page's next run


def plan_saved(said: str, name: str | None) -> None:
    """Draw the Plans page again after a plan is saved or imported: its lists above (Start from, Versions, Export)
    were drawn before it existed. The next run says ``said`` and edits plan ``name`` (None: what it was editing)."""
    st.session_state[PLAN_SAVED] = (said, name)
    st.rerun()


# ----------------------------------------------------------------------------------------------- charts, cached
@st.cache_resource(max_entries=256, show_spinner=False)
def _spec(key: tuple[Hashable, ...], _build: Callable[[], Any]) -> dict:
    return vega_spec(_build())


def chart(key: tuple[Hashable, ...], build: Callable[[], Any], **kwargs: Any) -> Any:
    """Draw the Altair chart ``build()`` makes, built once per ``key`` for every session (Streamlit copies a spec
    before it changes it): the key names what the chart is of, by stored results' ids (a job's results never change; a
    new job is a new id) or by :func:`frame_key` of the frame it draws. ``kwargs`` go to st.vega_lite_chart."""
    return st.vega_lite_chart(_spec(key, build), **kwargs)


def frame_key(df: pd.DataFrame) -> tuple[Hashable, ...]:
    """A key for what a frame holds: its columns and a hash of its rows."""
    try:
        rows = int(pd.util.hash_pandas_object(df, index=False).sum()) if len(df) else 0
    except TypeError:  # a cell holding a list or a dict
        rows = hash(df.to_json())
    return (tuple(map(str, df.columns)), rows)
