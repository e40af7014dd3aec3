"""The options several commands share, each defined once: the model argument, the job sizes and their defaults
(from the job specs, jobs.specs), the device, --local, --wait, --json, the GPUs a plan is served on, the KV cache
format, the KL budget and the ideal step's target. A command adds them with its own help text where it means
something of its own by them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeAlias

from jobs.specs import (
    BUDGET_S,
    CAL_SAMPLES,
    CAL_SEQ_LEN,
    CLIP_EPS,
    CONTEXT,
    KL_BUDGET,
    M_VALUE,
    PROMPT_TOKENS,
    ROLLOUT_LEN,
    ROLLOUTS,
    SAMPLES,
    SCORED_SEQ_LEN,
    SEQ_LEN,
    SERVED_BATCH,
    TENSOR_PARALLEL,
    BenchSpec,
    Limit,
    ScoreSpec,
)

ParserT = argparse.ArgumentParser
SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # what add_subparsers() returns

MODEL_HELP = "registered model id or name, or 'demo'"
GPU_TARGETS = "a100, l40s, h100, h100-pcie, h200, b200"


def bounded(limit: Limit) -> Callable[[str], Any]:
    """An argparse ``type=``: the option's text as a number that keeps ``limit``, the job parameter's one rule
    (jobs.specs), refused at parse time (exit status 2, before anything is read or written) in the rule's words."""

    def parse(text: str) -> Any:
        number, problem = limit.problem(text.strip())
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return number

    parse.__name__ = limit.name
    return parse


def add_model(sp: ParserT, help: str = MODEL_HELP, *, optional: bool = False) -> None:
    """The MODEL argument: a registered model's id or name (``optional``: may be left out)."""
    sp.add_argument("model", help=help, **({"nargs": "?"} if optional else {}))


def add_plan_model(sp: ParserT, help: str = "model of a plan file that does not name one") -> None:
    """--model: the model of a plan file (or of an imported file) that does not name one."""
    sp.add_argument("--model", help=help)


def add_json(sp: ParserT, help: str = "print the result as JSON") -> None:
    """--json: machine-readable output instead of lines for people."""
    sp.add_argument("--json", action="store_true", help=help)


def add_device(sp: ParserT, help: str = "cpu or cuda (default: QUANTPLAN_DEFAULT_DEVICE)") -> None:
    """--device: where the job runs (None: the command or QUANTPLAN_DEFAULT_DEVICE decides)."""
    sp.add_argument("--device", default=None, help=help)


def add_local(sp: ParserT, help: str = "run in this process instead of on a worker") -> None:
    """--local: run the job's body in this process (quantplan.cli.local), no worker."""
    sp.add_argument("--local", action="store_true", help=help)


def add_wait(sp: ParserT, help: str) -> None:
    """--wait: wait for a job the command queues besides its own answer."""
    sp.add_argument("--wait", action="store_true", help=help)


def _seconds(text: str) -> float:
    """A positive number of seconds, or argparse's error naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_timeout(sp: ParserT) -> None:
    """--timeout SECONDS: how long a command waits for the job it queued (None: until it ends; a job whose worker
    died ends failed by the wait's own stale sweep). The one definition every waiting command adds."""
    sp.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                    help="stop waiting for the queued job after this many seconds (it goes on; exit 1); default: "
                    "wait until it ends (a job whose worker died is failed after QUANTPLAN_HEARTBEAT_STALE_S)")


def add_run_options(sp: ParserT) -> None:
    """--device / --local / --timeout / --json, shared by every job command."""
    add_device(sp)
    add_local(sp)
    add_timeout(sp)
    add_json(sp)


def add_text_job_options(sp: ParserT, *, text: str, samples: int, seq_len: int = ScoreSpec.seq_len,
                         scored: bool = True) -> None:
    """The model argument and the options every job over text shares (calibrate, score, sensitivity): the text,
    its sequences (default ``samples``, the job spec's) and tokens each (``scored``: at least two, the first
    predicts nothing), then :func:`add_run_options`."""
    add_model(sp)
    sp.add_argument("--text", help=text)
    sp.add_argument("--samples", type=bounded(SAMPLES), default=samples,
                    help=f"number of sequences (default {samples})")
    sp.add_argument("--seq-len", type=bounded(SCORED_SEQ_LEN if scored else SEQ_LEN), default=seq_len,
                    help=f"tokens per sequence, at most the model's context (default {seq_len})")
    add_run_options(sp)
    add_stream(sp)


def add_stream(sp: ParserT) -> None:
    """--stream / --no-stream: the job's ``stream`` (jobs.specs); unset, the worker decides by its memory budget."""
    sp.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                    help="run the model one decoder block at a time from its stored safetensors (--stream) or whole "
                         "(--no-stream); default: whole where the weights fit the worker's memory budget "
                         "(QUANTPLAN_MODEL_MEMORY_GIB, else the device's free memory), streamed where they do not")


def stream_param(args: argparse.Namespace) -> dict[str, bool]:
    """``{"stream": True | False}`` as --stream / --no-stream asked; empty when neither did."""
    stream = getattr(args, "stream", None)
    return {} if stream is None else {"stream": bool(stream)}


def add_rotation(sp: ParserT, what: str) -> None:
    """--rotation KIND [--rotation-block N] [--rotation-seed S]: a Hadamard rotation (R1 + R2 + R4, as a plan's
    transforms.rotation) applied to the model for the job (issue #46)."""
    sp.add_argument("--rotation", choices=("hadamard", "random-hadamard"),
                    help=f"rotate the model R1 + R2 + R4 (as a plan's transforms.rotation does; "
                         f"docs/results/rotations.md) and {what}; whole or streamed")
    sp.add_argument("--rotation-block", type=int, metavar="N",
                    help="with --rotation: a block-diagonal Hadamard of order N for R1 and R4 (default: the whole "
                         "width)")
    sp.add_argument("--rotation-seed", type=int, metavar="S", help="with --rotation random-hadamard: its seed "
                    "(default 0)")


def rotation_param(args: argparse.Namespace) -> dict[str, Any]:
    """``{"rotation": {...}}`` as --rotation / --rotation-block / --rotation-seed asked (checked as a plan file's
    transforms.rotation is, ValueError naming the problem); empty without --rotation."""
    kind = getattr(args, "rotation", None)
    block, seed = getattr(args, "rotation_block", None), getattr(args, "rotation_seed", None)
    if kind is None:
        if block is not None or seed is not None:
            raise ValueError("--rotation-block and --rotation-seed go with --rotation hadamard | random-hadamard")
        return {}
    from quantcore.algorithms.rotation_spec import rotation_from_dict

    entry: dict[str, Any] = {"kind": kind, **({"block_size": block} if block is not None else {}),
                             **({"seed": seed} if seed is not None else {})}
    return {"rotation": rotation_from_dict(entry, "--rotation").to_dict()}


def add_calibration_options(sp: ParserT) -> None:
    """The calibration text of a score or sweep (GPTQ Hessians, AWQ and KV cache scales); unset: the spec's."""
    sp.add_argument("--cal-text", metavar="FILE", help="calibration text for GPTQ Hessians, AWQ scales and KV cache "
                    "scales (.txt / .jsonl); default: gensim's lee_background.cor, never the evaluation text")
    sp.add_argument("--cal-samples", type=bounded(CAL_SAMPLES), metavar="N",
                    help=f"calibration sequences (default {ScoreSpec.cal_samples})")
    sp.add_argument("--cal-seq-len", type=bounded(CAL_SEQ_LEN), metavar="L",
                    help=f"tokens per calibration sequence (default {ScoreSpec.cal_seq_len})")


def add_rollout_options(sp: ParserT) -> None:
    """--rollouts / --rollout-len / --clip-eps: a score's rollout drift (quantcore.evaluation.rollouts)."""
    sp.add_argument("--rollouts", type=bounded(ROLLOUTS), metavar="N", help="also sample N sequences from the "
                    "quantized model and measure their drift from the unquantized one (RL rollouts from a "
                    "low-precision copy of the policy)")
    sp.add_argument("--rollout-len", type=bounded(ROLLOUT_LEN), default=ScoreSpec.rollout_len, metavar="TOKENS",
                    help=f"tokens each rollout generates (default {ScoreSpec.rollout_len})")
    sp.add_argument("--clip-eps", type=bounded(CLIP_EPS), default=ScoreSpec.clip_eps, metavar="EPS",
                    help=f"PPO's clip range ε: the share of rollouts whose importance ratio leaves [1-ε, 1+ε] "
                    f"(default {ScoreSpec.clip_eps:g})")


def add_tensor_parallel(sp: ParserT, help: str) -> None:
    """--tensor-parallel / --tp GPUS: the GPUs a plan is served (scored, timed, exported) on."""
    sp.add_argument("--tensor-parallel", "--tp", type=bounded(TENSOR_PARALLEL), metavar="GPUS", help=help)


def add_expert_parallel(sp: ParserT, help: str = "an MoE model's experts whole, one GPU each (vLLM "
                        "--enable-expert-parallel), not split over the GPUs") -> None:
    """--expert-parallel: with several GPUs, an MoE model's experts whole, one GPU each."""
    sp.add_argument("--expert-parallel", action="store_true", help=help)


def add_gpu_options(sp: ParserT, what: str, more: str = "") -> None:
    """--tp / --expert-parallel of a score or sweep: ``what`` is quantized as served on that many GPUs."""
    add_tensor_parallel(sp, f"{what} as served on this many GPUs: each GPU quantizes its share of a row-parallel "
                        f"layer's input (o_proj, down_proj) on its own dynamic scale{more}")
    add_expert_parallel(sp, "with --tp: an MoE model's routed experts whole, one GPU each (vLLM "
                        "--enable-expert-parallel)")


def add_kv_cache(sp: ParserT, help: str, *, required: bool = False) -> None:
    """--kv-cache FORMAT: a KV cache format of quantcore.evaluation.kvcache."""
    sp.add_argument("--kv-cache", metavar="FORMAT", required=required, help=help)


def add_kl_budget(sp: ParserT, help: str) -> None:
    """--kl-budget: the most KL (nats per token) a plan's prediction may reach."""
    sp.add_argument("--kl-budget", type=bounded(KL_BUDGET), required=True, help=help)


def add_budget(sp: ParserT) -> None:
    """--budget: a benchmark's seconds per shape (unset: the bench spec's)."""
    sp.add_argument("--budget", type=bounded(BUDGET_S), default=None, help="seconds per shape before a case is skipped "
                    f"(default {BenchSpec.budget_s:g}); a case skipped under this budget or a larger one is not "
                    "measured again")


def add_target(sp: ParserT, help: str, *, required: bool = False) -> None:
    """--target: a GPU of quantcore.kernels.hardware's table."""
    sp.add_argument("--target", required=required, help=help)


def add_ideal_options(sp: ParserT, what: str) -> None:
    """--target / --batch / --prompt: the ideal (roofline) step times on a GPU of the table."""
    add_target(sp, f"add {what} on this GPU: {GPU_TARGETS}")
    sp.add_argument("--batch", type=bounded(SERVED_BATCH), default=1,
                    help="sequences of the ideal decode step, one token each (default 1)")
    sp.add_argument("--prompt", type=bounded(PROMPT_TOKENS), default=2048,
                    help="tokens of the ideal prefill step (default 2048)")


def m_values(text: str) -> list[int]:
    """An argparse ``type=``: comma-separated M values (quantcore.kernels.records.parse_ms), each within the
    benchmark spec's rule for M (jobs.specs.M_VALUE), refused at parse time."""
    from quantcore.kernels.records import parse_ms

    try:
        ms = parse_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    for m in ms:
        _, problem = M_VALUE.problem(m)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
    return ms


def add_context(sp: ParserT, help: str, default: int | None = None) -> None:
    """--context: tokens of context a sequence holds (its KV cache)."""
    sp.add_argument("--context", type=bounded(CONTEXT), default=default, help=help)


def add_step_m(sp: ParserT, flag: str, help: str, default: int | None = None) -> None:
    """An M option (``--m``, ``--m-prefill``...): rows of a step's GEMMs, batch x tokens, as a benchmark's M."""
    sp.add_argument(flag, type=bounded(M_VALUE), default=default, help=help)
