"""`quantplan migrate | up | worker | app`: the schema, and starting the product's processes."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from quantplan.cli.common import CliError, checked_settings, comma_items, current_settings
from quantplan.cli.local import describe_device
from quantplan.cli.options import SubParsers

REPO_ROOT = Path(__file__).resolve().parents[2]


def cmd_migrate(args: argparse.Namespace) -> int:
    """`quantplan migrate`: create or upgrade the database schema."""
    from store.db import current_revision, upgrade

    s = current_settings()
    upgrade(s)
    print(f"database at revision {current_revision(s)} ({s.database_url})")
    return 0


def advertised_queues(configured: str) -> str:
    """The configured queues plus the device class this machine serves: a worker on an H100 also takes
    'gpu' and 'gpu.sm90', so a job routed to the hardware it must measure lands on that hardware."""
    queues = list(dict.fromkeys(comma_items(configured)))
    device, _, device_class, _ = describe_device(queues)  # a GPU only when a gpu queue asks for one
    if device == "cuda" and "gpu" in queues and device_class not in queues:
        queues.append(device_class)
    return ",".join(queues)


def _gpu_list(text: str) -> str:
    """``--gpus``: comma-separated CUDA device indices (0,1,2,3), as CUDA_VISIBLE_DEVICES takes them."""
    items = [t.strip() for t in text.split(",")]
    if not items or not all(t.isdigit() for t in items) or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"--gpus takes distinct device indices separated by commas, such as "
                                         f"0,1,2,3; got {text!r}")
    return ",".join(items)


def cmd_worker(args: argparse.Namespace) -> int:
    """`quantplan worker`: become a Celery worker on the configured queues (and this machine's device class)."""
    s = checked_settings()
    queues = advertised_queues(args.queues or s.worker_queues)
    print(f"quantplan worker: consuming queues {queues}", file=sys.stderr, flush=True)
    if args.gpus is not None:  # the devices its jobs may spread a model over (quantcore.models.placement)
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus
    name = args.name or f"quantplan-{queues.replace(',', '-')}@%h"  # two workers on one host: give each a name
    # solo: one job at a time in the worker's own process (say so: Celery's banner would show the CPU count)
    cmd = [sys.executable, "-m", "celery", "-A", "worker.celery_app:celery_app", "worker", "-P", "solo",
           "--concurrency", "1", "-Q", queues, "-n", name,
           "--loglevel", args.loglevel]
    os.execvp(cmd[0], cmd)
    return 0  # not reached


def _streamlit_cmd(s) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(REPO_ROOT / "app" / "main.py"),
            "--server.port", str(s.ui_port), "--server.address", s.ui_address, "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--server.maxUploadSize", str(s.upload_limit_mb),
            "--client.toolbarMode", "viewer"]  # no "Deploy" (to Streamlit's cloud) or developer menu


def refuse_open_binding(s) -> None:
    """CliError, with the fix, where the app would listen beyond this machine without a sign-in."""
    from quantplan.services.access import binding_problem

    if problem := binding_problem(s.ui_address, s.auth):
        raise CliError(problem)


def cmd_app(args: argparse.Namespace) -> int:
    """`quantplan app`: become the Streamlit app (refused on a non-loopback address without a sign-in)."""
    s = checked_settings()
    refuse_open_binding(s)
    cmd = _streamlit_cmd(s)
    os.execvp(cmd[0], cmd)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def cmd_up(args: argparse.Namespace) -> int:
    """Migrate, then start one worker and the app; Ctrl-C stops both, and so does a SIGTERM or SIGHUP to this
    process alone (``kill PID``, a supervisor stopping it, its terminal gone): it stops its children before it ends
    rather than leaving them running, holding the port and the queue. One child that ends stops the other."""
    from store.db import upgrade

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a shell's `cmd &` ignores it
        signal.signal(sig, _interrupt)
    s = current_settings()
    refuse_open_binding(s)
    upgrade(s)
    env = dict(os.environ, QUANTPLAN_HOME=str(s.home))
    procs: list[subprocess.Popen] = []
    try:  # a signal between the two starts still stops the first
        procs.append(subprocess.Popen([sys.executable, "-m", "quantplan", "worker"], env=env, cwd=REPO_ROOT))
        procs.append(subprocess.Popen(_streamlit_cmd(s), env=env, cwd=REPO_ROOT))
        print(f"\nquantplan is starting: open http://{s.ui_address}:{s.ui_port}  "
              f"(database {s.database_url}, worker queues {s.worker_queues}). Ctrl-C stops it.\n", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(1)
        names = ("worker", "app")
        ended = next(i for i, p in enumerate(procs) if p.returncode is not None)
        print(f"quantplan: the {names[ended]} exited (code {procs[ended].returncode}); stopping the "
              f"{names[1 - ended]}.", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    failed = [p for p in procs if p.returncode not in (0, -signal.SIGTERM, None)]
    return 1 if failed else 0


def add_commands(sub: SubParsers) -> None:
    """migrate, up, worker, app."""
    sub.add_parser("migrate", help="create or upgrade the database schema").set_defaults(func=cmd_migrate)
    sub.add_parser("up", help="migrate, then start a worker and the web app").set_defaults(func=cmd_up)
    sp = sub.add_parser("worker", help="start a Celery worker")
    sp.add_argument("--queues", help="comma-separated queues (default: QUANTPLAN_WORKER_QUEUES)")
    sp.add_argument("--loglevel", default="INFO", help="Celery log level (default INFO)")
    sp.add_argument("--name", help="the worker's Celery node name (default quantplan-QUEUES@%%h); each worker on "
                                   "one host needs its own, e.g. cpu2@%%h, to take shards of a sweep beside another")
    sp.add_argument("--gpus", type=_gpu_list, help="the GPUs this worker's jobs use, e.g. 0,1,2,3 (sets "
                                                   "CUDA_VISIBLE_DEVICES): a model that fits across them is placed "
                                                   "with accelerate's device_map")
    sp.set_defaults(func=cmd_worker)
    sub.add_parser("app", help="start the Streamlit app").set_defaults(func=cmd_app)
