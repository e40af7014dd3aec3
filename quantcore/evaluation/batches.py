"""Running a causal LM over evaluation tokens in batches: the token batch, the forward pass, progress and cancel.

Evaluation tokens are a LongTensor ``[S, L]``: S sequences of L tokens, no padding
(``quantcore.evaluation.text`` chunks the evaluation text that way). Position ``t`` of a
sequence predicts token ``t + 1``; the L - 1 predicted positions of each sequence
are scored. The reference (:mod:`quantcore.evaluation.reference`), scoring and the sensitivity sweep all run the
model through these functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

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


# ---------------------------------------------------------------------- logits a chunk of positions at a time

# A chunk of logits is at most about this many float32 elements (64 MB): Gemma 3's 262,144-token vocabulary gives
# 64 positions a chunk, SmolLM2's 49,152 gives 341. Whatever the batch and sequence length, a score holds one chunk
# of logits (plus its work buffers), never [B, L, V].
LOGIT_CHUNK_ELEMENTS = 1 << 24
# Causal LMs whose logits are exactly ``lm_head(model.model(...).last_hidden_state)``, then Gemma 2 / 3's final
# soft-capping where the config has one: :func:`iter_logits` runs their head a chunk of positions at a time. Any
# other model (a head with a logit scale, an encoder) is run whole by :func:`forward_logits`, as before.
HEAD_SPLIT_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3", "olmo", "olmo2",
})


def logit_chunk_rows(vocab: int, elements: int = LOGIT_CHUNK_ELEMENTS) -> int:
    """Positions per chunk of logits: ``elements // vocab``, at least 1."""
    return max(1, elements // max(1, vocab))


def _head_split(model: nn.Module, *, hooked_head: bool = False) -> tuple[nn.Module, nn.Module, float | None] | None:
    """(decoder body, head, final soft-cap or None) when the model's logits are exactly head(body) (soft-capped);
    None when they are not known to be (the model is then run whole). ``hooked_head``: a head with forward hooks is
    split too (the caller runs them on each chunk, as the sensitivity sweep does)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in HEAD_SPLIT_MODEL_TYPES:
        return None
    body = getattr(model, "model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(body, nn.Module) or not isinstance(head, nn.Module) or (head._forward_hooks and not hooked_head):
        return None  # a forward hook on the head would see chunks instead of the whole output
    cap = getattr(config, "final_logit_softcapping", None)
    return body, head, (float(cap) if cap is not None else None)


def tied_head(model: nn.Module) -> bool:
    """True when the model's head (``lm_head``) and its input embedding are one weight (``tie_word_embeddings``)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    weight = getattr(emb, "weight", None)
    return weight is not None and weight is getattr(head, "weight", None)


@contextmanager
def embedding_rows(model: nn.Module, input_ids: Tensor) -> Iterator[None]:
    """The input embedding reads, while the block runs, a copy of only the rows of the tokens in ``input_ids``: the
    lookups are bit-equal to the whole table's, and the table itself can be rounded in place under a tied head (a
    score that keeps no original weights, :func:`quantcore.algorithms.apply.apply_plan`) without the lookups seeing
    it. A token outside ``input_ids`` is refused with PlanError."""
    emb = cast(Any, model).get_input_embeddings()
    if not isinstance(emb, nn.Embedding):
        raise PlanError(f"the input embedding is a {type(emb).__name__}, not an nn.Embedding: its rows cannot be kept "
                        "apart from a tied head")
    table = emb.weight
    tokens = torch.unique(input_ids.to(table.device))  # sorted
    emb.weight = nn.Parameter(table.detach()[tokens].clone(), requires_grad=False)

    def lookup(_module: nn.Module, args: tuple) -> tuple:
        ids = args[0]
        at = torch.searchsorted(tokens, ids).clamp_(max=tokens.numel() - 1)
        if not bool((tokens[at] == ids).all()):
            raise PlanError("a token outside the evaluation text reached the input embedding while only the "
                            "evaluation's rows were kept")
        return (at, *args[1:])

    hook = emb.register_forward_pre_hook(lookup)
    try:
        yield
    finally:
        hook.remove()
        emb.weight = table


def run_forward(model: nn.Module, input_ids: Tensor) -> None:
    """Run the model on ``input_ids`` ``[B, L]`` for what its hooks see (no KV cache), without the logits where the
    head can be left out (:data:`HEAD_SPLIT_MODEL_TYPES`): a pass that observes the layers needs no ``[B, L, V]``."""
    split = _head_split(model)
    if split is None:
        forward_logits(model, input_ids)
        return
    with torch.no_grad():
        split[0](input_ids=input_ids.to(model_device(model)), use_cache=False)


def _identity(x: Tensor) -> Tensor:
    return x


def _head_input(head: nn.Module, hidden: Tensor) -> Tensor:
    """The head's input after its forward pre-hooks (a plan's activation quantization), run once on the whole
    ``[B, L, H]`` hidden state as the model's own forward runs them: a dynamic per-tensor scale is taken over all of
    it, not per chunk, and saturation is counted once."""
    if not head._forward_pre_hooks:
        return hidden
    head.forward = _identity  # __call__ runs the pre-hooks, then this
    try:
        return head(hidden)
    finally:
        del head.forward


def iter_logits(model: nn.Module, input_ids: Tensor, *, chunk_elements: int = LOGIT_CHUNK_ELEMENTS,
                ) -> Iterator[tuple[int, int, int, Tensor]]:
    """The next-token logits of ``input_ids`` ``[B, L]`` a chunk at a time: ``(sequence, start, end, logits)``
    with float32 ``logits`` ``[end - start, V]`` for the predicted positions ``start:end`` of ``range(L - 1)``
    (the last position predicts nothing scored and is not computed).

    The decoder runs once on the whole batch (no KV cache); the head (``lm_head``, then a final soft-cap as in
    Gemma 2 / 3's forward) runs on a chunk of positions at a time, so at most one chunk of about
    ``chunk_elements`` float32 logits exists at once, besides the hidden states. The head's forward pre-hooks (a
    plan's activation quantization) run once on the whole hidden state, as in the model's own forward. For a model
    not in :data:`HEAD_SPLIT_MODEL_TYPES` the whole forward runs (:func:`forward_logits`) and its logits are
    handed out in the same chunks. Every chunking is a function of the shapes alone, so the reference and a scored
    plan see the same chunks and an identity plan's logits are bit-equal to the reference's.
    """
    ids = input_ids.to(model_device(model))
    n, length = ids.shape
    split = _head_split(model)
    if split is None:
        logits = forward_logits(model, ids)
        rows = logit_chunk_rows(logits.shape[-1], chunk_elements)
        for j in range(n):
            for s in range(0, length - 1, rows):
                e = min(s + rows, length - 1)
                yield j, s, e, logits[j, s:e]
        return
    body, head, cap = split
    with torch.no_grad():
        hidden = body(input_ids=ids, use_cache=False).last_hidden_state
        x = _head_input(head, hidden)
        del hidden
        vocab = int(getattr(head, "out_features", 0) or cast(Any, model).config.get_text_config().vocab_size)
        rows = logit_chunk_rows(vocab, chunk_elements)
        forward = type(head).forward  # the head's own computation, its pre-hooks already applied to x
        for j in range(n):
            for s in range(0, length - 1, rows):
                e = min(s + rows, length - 1)
                logits = forward(head, x[j, s:e])
                if cap is not None:
                    logits = torch.tanh(logits / cap) * cap
                yield j, s, e, logits.float()
