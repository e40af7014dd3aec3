"""Running a causal LM over evaluation tokens in batches: the token batch, the forward pass, progress and cancel.

Evaluation tokens are a LongTensor ``[S, L]``: S sequences of L tokens, no padding
(``quantcore.evaluation.text`` chunks the evaluation text that way). Position ``t`` of a
sequence predicts token ``t + 1``; the L - 1 predicted positions of each sequence
are scored. The reference (:mod:`quantcore.evaluation.reference`), scoring and the sensitivity sweep all run the
model through these functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from quantcore.errors import Cancelled, PlanError

Progress = Callable[[float, str], None]
ShouldCancel = Callable[[], bool]

DEFAULT_BATCH_SIZE = 4  # sequences per forward pass


def check_cancel(should_cancel: ShouldCancel | None, what: str) -> None:
    """Raise :class:`Cancelled` (message names ``what``) when ``should_cancel()`` is true."""
    if should_cancel is not None and should_cancel():
        raise Cancelled(f"{what} was cancelled")


def report_progress(progress: Progress | None, fraction: float, message: str) -> None:
    """Call ``progress(fraction, message)`` with the fraction clamped to [0, 1]."""
    if progress is not None:
        progress(min(max(fraction, 0.0), 1.0), message)


def model_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter (CPU for a parameterless module)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def as_token_batch(input_ids: Tensor) -> Tensor:
    """Evaluation tokens as int64 ``[S, L]`` on the CPU; a 1-D ``[L]`` tensor is one sequence."""
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    ids = input_ids.detach().to("cpu", torch.int64)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(
            f"input_ids must be [sequences, length] with length >= 2 (one position to predict), "
            f"got shape {tuple(input_ids.shape)}"
        )
    return ids.contiguous()


def forward_logits(model: nn.Module, input_ids: Tensor) -> Tensor:
    """Logits ``[B, L, V]`` (float32) of a causal LM for ``input_ids`` ``[B, L]``, no KV cache."""
    with torch.no_grad():
        out = model(input_ids=input_ids.to(model_device(model)), use_cache=False)
    if getattr(out, "logits", None) is None:
        raise PlanError(
            f"{type(model).__name__} returns no next-token logits: it is not a causal language model (an encoder "
            "such as BERT, or a base model without its head). KL scoring and sensitivity compare next-token "
            "distributions, so they need the ...ForCausalLM checkpoint; calibration and outliers work as they are"
        )
    return out.logits.float()


def batch_ranges(n: int, batch_size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(n)`` in steps of ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
