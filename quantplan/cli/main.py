"""The ``quantplan`` command: migrate, run the product, and queue or run jobs from a terminal."""

from __future__ import annotations

import argparse
import os
import sys

import quantplan.cli.compare as compare_commands
import quantplan.cli.history as history_commands
import quantplan.cli.jobs as job_commands
import quantplan.cli.models as model_commands
import quantplan.cli.plans as plan_commands
import quantplan.cli.run as run_commands
import quantplan.cli.scores as score_commands
import quantplan.cli.system as system_commands
import quantplan.cli.team as team_commands
from quantplan.cli.common import CliError, Interrupted, current_settings
from store.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command group, in the order ``quantplan --help`` lists them."""
    p = argparse.ArgumentParser(prog="quantplan", description=__doc__)
    p.add_argument("--as", dest="as_user", metavar="NAME",
                   help="act as NAME: the name this command's jobs, plans and audit lines carry (QUANTPLAN_USER); "
                        "the CLI has an operator's access to the database")
    sub = p.add_subparsers(dest="command", required=True)
    system_commands.add_commands(sub)
    model_commands.add_commands(sub)
    run_commands.add_calibrate_command(sub)
    job_commands.add_commands(sub)
    run_commands.add_commands(sub)
    score_commands.add_commands(sub)
    compare_commands.add_commands(sub)
    plan_commands.add_commands(sub)
    team_commands.add_commands(sub)
    history_commands.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: the process's arguments); its exit status: 0 done, 1 refused or failed
    (a line on stderr), 130 interrupted
    (143: a --local job ended by SIGTERM), 141 a closed pipe."""
    # no HF_HUB_OFFLINE default: every checkpoint is read from a local folder (local_files_only), and the Hub is
    # reached only by a registration by hub id (quantcore.models.hub), which an admin forbids by setting it
    # transformers' own tqdm bars (GGUF conversion, weight loading) would interleave with quantplan's job
    # progress lines in the terminal and fill worker logs with carriage returns
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "as_user", None):
        from store.settings import get_settings

        os.environ["QUANTPLAN_USER"] = args.as_user.strip()
        get_settings.cache_clear()  # read again with the name
    # the command prints its own progress: first-party log lines only from WARNING up, unless asked for
    configure_logging(os.environ.get("QUANTPLAN_LOG_LEVEL") or "WARNING")
    if getattr(args, "device", "unset") is None:
        args.device = current_settings().default_device
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here, where it is handled, not at interpreter exit
        return code
    except Interrupted as exc:
        print(f"\nquantplan: {exc}", file=sys.stderr)
        return exc.exit_code  # 130 for Ctrl-C, 143 for a SIGTERM that ended a --local job
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
