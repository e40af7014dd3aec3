"""What the browser tests share: Debian's Chromium, headless (./dev.sh test installs it; never a browser download)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# how long a page may take to draw what the database already says: generous, so that a machine whose cores are busy
# elsewhere only makes a test slower, never wrong
PAGE_TIMEOUT_MS = 180_000

# true once Streamlit's script is not running and the page's DOM has not changed for the given milliseconds
_QUIET = """(quiet) => {
  if (!window.__qpQuiet) {
    window.__qpLast = performance.now();
    window.__qpQuiet = new MutationObserver(() => { window.__qpLast = performance.now(); });
    window.__qpQuiet.observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true});
  }
  const app = document.querySelector('[data-testid="stApp"]');
  return app !== null && app.getAttribute('data-test-script-state') === 'notRunning'
    && document.querySelector('[data-testid="stStatusWidget"]') === null
    && performance.now() - window.__qpLast >= quiet;
}"""


def settle(page, quiet_ms: int = 1000) -> None:
    """Wait for the page to be settled: the script not running, no running indicator, and no change of the DOM for
    ``quiet_ms`` (a rerun a click asked for may start a moment after the click: the quiet covers that moment)."""
    page.wait_for_function(_QUIET, arg=quiet_ms, polling=100)


def no_exception(page) -> None:
    """No element of the page shows a Python exception (the first one's text if one does)."""
    exc = page.locator("[data-testid='stException']")
    assert exc.count() == 0, exc.first.inner_text()


# read when the tests are collected: the qp_env fixture clears every QUANTPLAN_* variable before a test runs
SHOTS = Path(os.environ["QUANTPLAN_SCREENSHOTS"]) if os.environ.get("QUANTPLAN_SCREENSHOTS") else None


def screenshot(page, name: str) -> None:
    """The whole page as ``NAME.png`` in the folder QUANTPLAN_SCREENSHOTS names, where it is set (nothing otherwise)."""
    if SHOTS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
