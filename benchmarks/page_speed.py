"""What a person waits for on each page, measured in a real browser: headless Chromium at 1400 x 1000 against
``streamlit run app/main.py`` on a database this script seeds, beside a bare one-line Streamlit page timed in the
same run (the floor: what Streamlit itself costs on this machine).

Seeded through the CLI, as a person would (``--local``: the job bodies run in the CLI's process, no worker): the demo
model (SmolLM2-135M, ``--quick``: a tiny Llama) registered and calibrated, three plans (one in two versions), scores
of two presets and of both versions of the plan, sensitivity sweeps of two schemes and a kernel benchmark.

For every page, from the navigation's start (``performance.now()`` in the page, so the browser's own clock):

- **first chart**: the first Vega-Lite chart drawn in the page (its SVG or canvas; — on a page without a chart);
- **settled**: the last change to the page's DOM before it was quiet for ``--quiet-ms`` (500 ms) with Streamlit's
  script state "notRunning" and its running indicator gone: every element drawn, every chart embedded;
- **interaction**: from the input event (a key or click in the page) to the page settled again, for a layer picked
  on Outliers (the page as it opens, its sections below the fold closed) and the α slider's one step (ArrowRight, its
  SmoothQuant section opened first: it builds on open), and a score added to the comparison on Results.

Each page is visited once to warm the server (imports, caches: printed as "cold"), then ``--repeat`` times; the
median is printed with its ratio to the floor's. Targets (issue #45, an idle 2-core machine): settled <= 2 s, first
chart <= 1 s, an interaction <= 0.3 s.

    .venv/bin/python benchmarks/page_speed.py [--repeat 3] [--quick] [--home DIR] [--json FILE]

Exits 1 where a page shows an exception or an interaction does not take effect (never for a missed target: a busy
machine misses them; read the ratios to the floor).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VIEWPORT = {"width": 1400, "height": 1000}
QUIET_MS = 500  # the page settled: no DOM change for this long, the script not running
PAGE_TIMEOUT_S = 120.0  # give up on a page that never settles
TARGETS = {"settled": 2.0, "first_chart": 1.0, "interaction": 0.3}  # seconds, on an idle 2-core machine
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# every page of the navigation (History and Compare where this tree has them); "models" is the root address
PAGES = tuple(p for p in ("models", "outliers", "plans", "results", "kernels", "compare", "jobs", "history")
              if (ROOT / "app" / "views" / f"{p}.py").exists())
FLOOR_SCRIPT = 'import streamlit as st; st.slider("α", 0.0, 1.0, 0.5, 0.05)\n'  # one line: a page and a control

# In every page before its own scripts: the time of the last DOM change, of the first chart drawn and of the last
# input event, all on performance.now() (0 = the navigation's start).
PROBE_JS = """
(() => {
  const qp = window.__qp = {last: 0, chart: null, input: null, ran: false};
  const chartSel = '[data-testid="stVegaLiteChart"] canvas, [data-testid="stVegaLiteChart"] svg.marks';
  let app = null;  // the app's root, found once (a query on every DOM change cost the page ~14 ms an α step)
  const state = () => { if (app === null || !app.isConnected) app = document.querySelector('[data-testid="stApp"]');
                        return app ? app.getAttribute('data-test-script-state') : null; };
  new MutationObserver(() => {
    const t = performance.now();
    qp.last = t;
    if (qp.chart === null && document.querySelector(chartSel)) qp.chart = t;
    if (qp.input !== null && state() === 'running') qp.ran = true;
  }).observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
  for (const kind of ['keydown', 'mousedown', 'click']) {
    window.addEventListener(kind, () => { qp.input = performance.now(); qp.ran = false; }, true);
  }
  qp.state = state;
})();
"""
POLL_JS = """() => ({now: performance.now(), last: window.__qp.last, chart: window.__qp.chart,
  input: window.__qp.input, ran: window.__qp.ran, state: window.__qp.state(),
  busy: !!document.querySelector('[data-testid="stStatusWidget"] [data-testid="stStatusWidgetRunningIcon"],'
                                 + '[data-testid="stStatusWidgetRunningManIcon"]'),
  exception: document.querySelectorAll('[data-testid="stException"]').length})"""


@dataclass
class Visit:
    first_chart: float | None  # seconds from the navigation's start
    settled: float
    exceptions: int


@dataclass
class PageResult:
    name: str
    cold: Visit | None = None
    visits: list[Visit] = field(default_factory=list)
    interactions: dict[str, list[float]] = field(default_factory=dict)

    def median(self, what: str) -> float | None:
        values = [getattr(v, what) for v in self.visits if getattr(v, what) is not None]
        return statistics.median(values) if values else None


# ------------------------------------------------------------------------------------------------ seeding
def _python(env: dict[str, str], code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"seeding failed:\n{code}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout


def seed(home: Path, quick: bool) -> int:
    """Seed the deployment in ``home`` through the CLI's commands (and the plans through the application layer), all
    in one process (one start of Python and torch, not one a command); the model's id."""
    env = {**os.environ, "QUANTPLAN_HOME": str(home), "QUANTPLAN_USER": "bench", "QUANTPLAN_AUTH": "none"}
    env = {k: v for k, v in env.items() if not k.startswith("QUANTPLAN_") or k in (
        "QUANTPLAN_HOME", "QUANTPLAN_USER", "QUANTPLAN_AUTH", "QUANTPLAN_CACHE_DIR")}
    if quick:
        from tests.factories import save_tiny_llama

        add = ["models", "add", str(save_tiny_llama(home / "src" / "tiny-llama")), "--name", "tiny"]
        model, sizes, sweep = "tiny", ["--samples", "2", "--seq-len", "32"], ["--samples", "1", "--seq-len", "16"]
    else:
        add = ["models", "add", "--demo"]
        model, sizes, sweep = "demo", ["--samples", "4", "--seq-len", "64"], ["--samples", "1", "--seq-len", "16"]
    first = [["migrate"], add, ["calibrate", model, "--local", *sizes],
             *(["score", model, "--local", "--scheme", scheme, *sizes] for scheme in ("FP8_DYNAMIC", "INT8_W8A8"))]
    then = [*(["sensitivity", model, "--local", "--scheme", scheme, *sweep]  # two schemes: Results draws both
              for scheme in ("INT8_W8A8", "FP8_DYNAMIC")),
            ["bench", model, "--local", "--m", "1,16", "--budget", "0.5", "--paths", "int8_row,int8_row+q,w8_row"]]
    samples, seq_len = int(sizes[1]), int(sizes[3])
    # two versions of one plan and another plan, saved through the application layer; both versions scored here
    out = _python(env, f"""
import sys
from quantplan.cli.main import main
def cli(argv):
    if main(argv):
        sys.exit("seeding failed: quantplan " + " ".join(argv) + " exited non-zero (its error above)")
for argv in {first!r}:
    cli(argv)
from quantplan.cli.common import run_job
from quantplan.services import models, plans
record = models.get_model({model!r})
first = plans.save_plan(record.id, "fp8-mlp", plans.new_plan_body(record, "FP8_DYNAMIC"))
second = plans.save_plan(record.id, "fp8-mlp", {{**first.body, "rules": [*first.body["rules"],
                         {{"match": "self_attn.o_proj", "scheme": "BF16"}}]}})
plans.save_plan(record.id, "int8", plans.new_plan_body(record, "INT8_W8A8"))
for plan in (first, second):
    run_job("score", {{"samples": {samples}, "seq_len": {seq_len}, "device": "cpu", "user": "bench"}},
            model_id=record.id, plan_id=plan.id, local=True, quiet=True)
for argv in {then!r}:
    cli(argv)
print("seeded model", record.id)
""")
    return int(out.rsplit("seeded model ", 1)[1].split()[0])


# ------------------------------------------------------------------------------------------------ the browser
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_streamlit(script: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    out = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(script), "--server.port", str(port),
                             "--server.address", "127.0.0.1", "--server.headless", "true",
                             "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer"],
                            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if "URL: http" in log.read_text():
            return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None:
            raise SystemExit(f"streamlit exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"streamlit did not start within 300 s:\n{log.read_text()[-3000:]}")


def wait_settled(page: Any, after_input: bool = False, timeout: float = PAGE_TIMEOUT_S) -> dict[str, Any]:
    """Poll until the script is not running, no running indicator shows and the DOM has been quiet for QUIET_MS
    (after an input: and the script ran after it, or the DOM changed after it); the last poll's state."""
    deadline = time.monotonic() + timeout
    while True:
        s = page.evaluate(POLL_JS)
        started = not after_input or (s["input"] is not None and (s["ran"] or s["last"] > s["input"]))
        if (started and s["state"] == "notRunning" and not s["busy"] and s["now"] - s["last"] >= QUIET_MS):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"the page did not settle within {timeout:.0f} s: {s}")
        page.wait_for_timeout(25)


def visit(page: Any, url: str) -> Visit:
    page.goto(url, wait_until="commit")
    s = wait_settled(page)
    chart = s["chart"] / 1000 if s["chart"] is not None else None
    return Visit(first_chart=chart, settled=s["last"] / 1000, exceptions=int(s["exception"]))


def interact(page: Any, action: Any, check: Any) -> float:
    """Seconds from the input event ``action`` makes to the page settled again; ``check`` says the effect shows."""
    action()
    s = wait_settled(page, after_input=True)
    if not check():
        raise SystemExit("an interaction did not take effect: see the page")
    return (s["last"] - s["input"]) / 1000


def _open_options(page: Any, label: str) -> Any:
    """Open the selectbox or multiselect labelled ``label`` (again, where a rerun closed it as it opened): its
    options."""
    options = page.get_by_role("option")
    for _ in range(5):
        page.get_by_label(label, exact=True).click()
        try:
            options.first.wait_for(timeout=10_000)
            return options
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: try again
            page.keyboard.press("Escape")
    raise SystemExit(f"the {label!r} box did not open, or has no option left to choose")


SMOOTHQUANT_BOX = "Smooth this layer"  # the label of the Outliers page's SmoothQuant expander (built when opened)


def open_expander(page: Any, label: str, shows: Any) -> None:
    """Open the expander whose label starts with ``label`` (a lazy section: it builds on open) and wait for the page
    to settle with ``shows`` (a locator) in it; nothing where no such expander is (an older tree: shown already)."""
    box = page.locator("[data-testid='stExpander'] summary", has_text=label)
    if box.count():
        box.first.click()
        wait_settled(page, after_input=True)
    shows.first.wait_for(timeout=PAGE_TIMEOUT_S * 1000)


def outliers_interactions(page: Any, res: PageResult) -> None:
    # a layer picked in the Layer box, on the page as it opens: the next one in its list (ranked by outlier ratio)
    option = _open_options(page, "Layer").nth(1)
    other = option.inner_text().strip()
    res.interactions.setdefault("layer pick", []).append(interact(
        page, option.click, lambda: page.get_by_text(f"Channels of {other}").count() > 0))
    # the α slider's one step, in the SmoothQuant section opened
    slider = page.locator("[data-testid='stSlider'] input[type='range']")
    open_expander(page, SMOOTHQUANT_BOX, slider)
    value = float(slider.first.get_attribute("value") or 0.5)
    slider.first.focus()
    res.interactions.setdefault("α slider step", []).append(interact(
        page, lambda: page.keyboard.press("ArrowRight"),
        lambda: page.get_by_text(f"Save α = {value + 0.05:.2f}").count() > 0))


def results_interactions(page: Any, res: PageResult) -> None:
    before = page.locator("[data-testid='stMetric']").count()

    def pick() -> None:
        for _ in range(3):  # the open list can be drawn anew under the pointer (a rerun as it opened): open it again
            try:
                _open_options(page, "Compare").first.click(timeout=10_000)
                return
            except Exception:  # noqa: BLE001 - playwright's TimeoutError
                page.keyboard.press("Escape")
        raise SystemExit("no option of the 'Compare' box could be clicked")

    # timed from the click on the option (the box's opening click is an input event before it)
    res.interactions.setdefault("compare selection", []).append(interact(
        page, pick, lambda: page.locator("[data-testid='stMetric']").count() > before))
    page.keyboard.press("Escape")


def floor_interaction(page: Any, res: PageResult) -> None:
    slider = page.locator("[data-testid='stSlider'] input[type='range']").first
    slider.focus()
    res.interactions.setdefault("slider step", []).append(interact(
        page, lambda: page.keyboard.press("ArrowRight"), lambda: True))


INTERACTIONS = {"outliers": outliers_interactions, "results": results_interactions}


def measure(app: str, floor: str, model_id: int, repeat: int) -> tuple[PageResult, list[PageResult]]:
    from playwright.sync_api import sync_playwright

    floor_res = PageResult("floor (one-line page)")
    results = [PageResult(name) for name in PAGES]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=VIEWPORT)
        page.add_init_script(PROBE_JS)
        urls = {r.name: f"{app}/{'' if r.name == 'models' else r.name}?model={model_id}" for r in results}
        floor_res.cold = visit(page, floor)
        for r in results:
            r.cold = visit(page, urls[r.name])
        for _ in range(repeat):  # the floor interleaved with the pages: both see the same load on the machine
            floor_res.visits.append(visit(page, floor))
            floor_interaction(page, floor_res)
            for r in results:
                r.visits.append(visit(page, urls[r.name]))
                if r.name in INTERACTIONS:
                    INTERACTIONS[r.name](page, r)
        browser.close()
    return floor_res, results


# ------------------------------------------------------------------------------------------------ report
def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f} s"


def _ratio(v: float | None, floor: float | None) -> str:
    return "—" if v is None or not floor else f"{v / floor:.1f}×"


def report(floor: PageResult, results: list[PageResult], repeat: int) -> list[str]:
    f_settled, f_step = floor.median("settled"), statistics.median(floor.interactions["slider step"])
    lines = [f"page speed, headless Chromium {VIEWPORT['width']}×{VIEWPORT['height']}, median of {repeat} visit(s); "
             f"settled = script not running and no DOM change for {QUIET_MS} ms",
             f"{'page':<22} {'first chart':>11} {'settled':>9} {'cold':>9} {'× floor':>8}   target settled "
             f"<= {TARGETS['settled']:g} s, first chart <= {TARGETS['first_chart']:g} s"]
    lines.append(f"{floor.name:<22} {'—':>11} {_s(f_settled):>9} {_s(floor.cold.settled if floor.cold else None):>9}"
                 f" {'1.0×':>8}")
    for r in results:
        settled, chart = r.median("settled"), r.median("first_chart")
        miss = [what for what, v in (("settled", settled), ("first_chart", chart)) if v is not None and
                v > TARGETS[what]]
        lines.append(f"{r.name:<22} {_s(chart):>11} {_s(settled):>9} {_s(r.cold.settled if r.cold else None):>9} "
                     f"{_ratio(settled, f_settled):>8}   {'missed: ' + ', '.join(miss) if miss else 'ok'}")
    lines.append(f"{'interaction':<34} {'median':>9} {'× floor':>8}   target <= {TARGETS['interaction']:g} s")
    lines.append(f"{'floor: slider step':<34} {_s(f_step):>9} {'1.0×':>8}")
    for r in results:
        for what, values in r.interactions.items():
            v = statistics.median(values)
            lines.append(f"{r.name + ': ' + what:<34} {_s(v):>9} {_ratio(v, f_step):>8}   "
                         f"{'ok' if v <= TARGETS['interaction'] else 'missed'}")
    return lines


def machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (f"{platform.node()}: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
            f"(1 / 5 / 15 min) at {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="measured visits of every page (after one to warm up)")
    ap.add_argument("--quick", action="store_true", help="a tiny Llama instead of the demo model (the tests)")
    ap.add_argument("--home", type=Path, help="seed here (kept), or reuse it where it is seeded already")
    ap.add_argument("--quiet-ms", type=int, default=QUIET_MS, help="how long the DOM stays unchanged to be settled")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if not Path(CHROMIUM).exists():
        print(f"no Chromium at {CHROMIUM}: install Debian's chromium", file=sys.stderr)
        return 2
    globals()["QUIET_MS"] = args.quiet_ms
    tmp = Path(tempfile.mkdtemp(prefix="page-speed-"))
    home = args.home or tmp / "home"
    print(machine(), flush=True)
    t0 = time.monotonic()
    marker = home / "page-speed-seeded"
    if marker.exists():
        model_id = int(marker.read_text())
    else:
        model_id = seed(home, args.quick)
        marker.write_text(str(model_id))
    print(f"seeded {home} in {time.monotonic() - t0:.0f} s", flush=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPLAN_") or k == "QUANTPLAN_CACHE_DIR"}
    env |= {"QUANTPLAN_HOME": str(home), "QUANTPLAN_AUTH": "none", "QUANTPLAN_USER": "bench"}
    (tmp / "floor.py").write_text(FLOOR_SCRIPT)
    app_proc, app = start_streamlit(ROOT / "app" / "main.py", env, tmp / "app.log")
    floor_proc, floor = start_streamlit(tmp / "floor.py", env, tmp / "floor.log")
    try:
        floor_res, results = measure(app, floor, model_id, args.repeat)
    finally:
        for proc in (app_proc, floor_proc):
            proc.terminate()
            proc.wait(timeout=30)
    lines = report(floor_res, results, args.repeat)
    print("\n".join(lines))
    print(machine())
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "floor": _as_dict(floor_res),
                                         "pages": [_as_dict(r) for r in results]}, indent=1))
    broken = [r.name for r in results if any(v.exceptions for v in [*r.visits, *([r.cold] if r.cold else [])])]
    if broken:
        print(f"exceptions shown on: {', '.join(broken)} (app log: {tmp / 'app.log'})", file=sys.stderr)
        return 1
    if not args.home:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _as_dict(r: PageResult) -> dict[str, Any]:
    return {"page": r.name, "first_chart_s": r.median("first_chart"), "settled_s": r.median("settled"),
            "cold_settled_s": r.cold.settled if r.cold else None,
            "interactions_s": {k: statistics.median(v) for k, v in r.interactions.items()},
            "visits": [vars(v) for v in r.visits]}


if __name__ == "__main__":
    sys.exit(main())
