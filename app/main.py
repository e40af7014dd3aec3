"""quantplan web app: page config, the shared sidebar, and navigation. Pages live in app/views/."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `streamlit run app/main.py` puts app/ on the path, not the repo root
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from app import auth, state  # noqa: E402
from store.logs import configure_logging  # noqa: E402

configure_logging()  # idempotent: Streamlit runs this file again on every interaction
st.set_page_config(page_title="quantplan", page_icon="🧮", layout="wide")
actor = auth.signed_in()  # stops the run at the sign-in where QUANTPLAN_AUTH asks for one and nobody is signed in

# not "pages/": Streamlit would also auto-discover that folder as a second, unmanaged navigation
PAGES_DIR = Path(__file__).resolve().parent / "views"
# The default page is served at the root URL only, whatever its url_path: /models would say "Page not found".
models_page = st.Page(str(PAGES_DIR / "models.py"), title="Models", url_path="home", default=True)


def _to_models() -> None:
    """/models, an address a person may type or keep from the page's title: the Models page, same query."""
    st.switch_page(models_page, query_params=st.query_params.to_dict())


pages = {
    "Model": [
        models_page,
        st.Page(_to_models, title="Models", url_path="models", visibility="hidden"),
        st.Page(str(PAGES_DIR / "outliers.py"), title="Outliers", url_path="outliers"),
    ],
    "Plan and measure": [
        st.Page(str(PAGES_DIR / "plans.py"), title="Plans", url_path="plans"),
        st.Page(str(PAGES_DIR / "results.py"), title="Results", url_path="results"),
        st.Page(str(PAGES_DIR / "kernels.py"), title="Kernels", url_path="kernels"),
        st.Page(str(PAGES_DIR / "compare.py"), title="Compare", url_path="compare"),  # ?jobs=ID,ID,...
    ],
    "Queue": [st.Page(str(PAGES_DIR / "jobs.py"), title="Jobs", url_path="jobs")],
    "Team history": [  # every run of the team; a run's own page (/run?job=ID) is reached from it
        st.Page(str(PAGES_DIR / "history.py"), title="History", url_path="history"),
        st.Page(str(PAGES_DIR / "run.py"), title="Run", url_path="run", visibility="hidden"),
    ],
}
if actor is not None:  # a signed-in team: its people, their roles and (for admins) the audit log
    pages["Team"] = [st.Page(str(PAGES_DIR / "users.py"), title="Users", url_path="users")]
nav = st.navigation(pages)
auth.sidebar_identity(actor)
state.sidebar()
nav.run()
