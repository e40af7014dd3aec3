"""Job bodies, one module per job kind: load the job's inputs, run quantcore, hand back results to the store.

Each body is a plain function of a :class:`worker.runner.JobContext` that returns an :class:`worker.runner.Outcome`
(test it without Celery); it reads its parameters through its kind's spec (jobs.specs) and converts the store's
records to quantcore's inputs. Heavy modules (torch, transformers) are imported inside the bodies.

==============  ===========================================================================
``register``    :mod:`worker.bodies.register`: validate, store and summarise a checkpoint
``calibrate``   :mod:`worker.bodies.calibrate`: activation statistics and K / V maxima
``score``       :mod:`worker.bodies.score`: KL of a plan against the unquantized model
``sensitivity`` :mod:`worker.bodies.sensitivity`: KL of one unit (or attention layer) at a time
``bench``       :mod:`worker.bodies.bench`: real GEMM timings on the model's shapes
==============  ===========================================================================

What they share: :mod:`worker.bodies.shared` (device, model, tokens) and :mod:`worker.bodies.evaluation` (the
reference log-probs, calibration statistics and the GPTQ / AWQ / KV cache inputs a score and a sweep read).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.runner import JobContext, Outcome

KINDS = ("register", "calibrate", "score", "sensitivity", "bench")


def body_for(kind: str) -> Callable[[JobContext], Outcome]:
    """The body that runs jobs of ``kind`` (its module's function of the same name, imported on first use);
    ValueError naming the kinds for another."""
    if kind not in KINDS:
        raise ValueError(f"no job body for kind {kind!r}; the kinds are {', '.join(KINDS)}")
    return getattr(importlib.import_module(f"worker.bodies.{kind}"), kind)


__all__ = ["KINDS", "body_for"]
