"""The unquantized model's next-token predictions on an evaluation set, computed once and kept.

Reference
    The unquantized model run on the evaluation tokens. Its next-token
    log-probabilities are computed once per (model, evaluation set) by
    :func:`compute_reference` and kept in a :class:`ReferenceCache`, saved as
    safetensors in the artifact store (:func:`reference_cache_path`), so scoring many
    plans never recomputes them.

Storage choice
    KL(p_ref || p_q) = sum_v p_ref(v) (log p_ref(v) - log p_q(v)) needs the *full*
    reference distribution at every position, so top-k truncation is not an option
    (it has no error bound on the high-entropy positions of small models). The cache
    keeps full-vocabulary log-probabilities in **float16** (2 bytes x vocab per
    token: SmolLM2, 49,152 tokens, 4k evaluation tokens -> 400 MB; float32 would be
    800 MB). float16 beats bfloat16 here: log-probs live in [-30, 0] for every token
    that carries mass, where float16's step is <= 2**-6 (bf16: 2**-3).

    To keep the identity plan's KL *exactly* 0, the quantized model's log-probs go
    through the very same compression before the KL (``log_softmax -> clamp at
    LOGPROB_FLOOR -> float16 -> float32 -> renormalize``), so for BF16 both sides are
    bit-identical and every term is ``p * (a - a) = 0``. Renormalizing after the
    rounding removes the (1e-4-sized) normalization offset the rounding leaves.
    What remains of the compression error is second order: on tiny models with
    FP8/INT8-class perturbations it moved the mean KL by about 1e-4 (relative) and
    the median by < 1 % (bfloat16 storage: about 1.6e-2 on the mean), see
    ``tests/quantcore/evaluation/test_scoring.py::test_float16_compression_error_is_small``.
    Pass ``logprob_dtype=torch.float32`` to :func:`compute_reference` for an
    uncompressed cache.

    NLL and argmax are computed from the full-precision logits on both sides, so
    perplexities and top-1 agreement carry no compression error at all.

Exactness
    Scoring runs the evaluation tokens in the same batches as the reference
    (``batch_size`` defaults to the reference's own), so an identity plan repeats the
    reference computation operation for operation.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from quantcore.errors import QuantcoreError
from quantcore.evaluation.batches import (
    DEFAULT_BATCH_SIZE,
    Progress,
    ShouldCancel,
    as_token_batch,
    batch_ranges,
    check_cancel,
    forward_logits,
    report_progress,
)

CACHE_FORMAT = "quantplan.reference.v1"  # safetensors metadata tag; bump on any layout change
LOGPROB_DTYPE = torch.float16  # storage dtype of the reference log-probs (see module docstring)
# log-probs are clamped here before the float16 cast: float16 overflows to -inf below
# -65504, and -inf - -inf = nan in the KL; exp(-1e4) is exactly 0 in float32 anyway.
LOGPROB_FLOOR = -1.0e4
# logits are processed a block of rows at a time, which bounds the temporaries: on a GPU ~4M elements
# (16 MB fp32) per block; on a CPU 256K (1 MB), so that the ten-odd passes over a block stay in the
# core's L2 cache (measured on SmolLM2's 49k vocabulary: 30 % less time than 16 MB blocks). The
# results are the same for any block size: every reduction runs along one row.
KL_CHUNK_ELEMENTS = 1 << 22
KL_CHUNK_ELEMENTS_CPU = 1 << 18
_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ReferenceMismatch(QuantcoreError, ValueError):
    """The reference cache does not belong to these evaluation tokens or this model."""


def compress_logprobs(logprobs: Tensor, dtype: torch.dtype = LOGPROB_DTYPE) -> Tensor:
    """Storage form of log-probs ``[..., V]``: clamped at LOGPROB_FLOOR, cast to ``dtype``."""
    return logprobs.clamp_min(LOGPROB_FLOOR).to(dtype)


def expand_logprobs(stored: Tensor) -> Tensor:
    """float32 log-probs ``[..., V]`` from the storage form, renormalized to sum to 1 in prob space."""
    x = stored.float()
    return x - torch.logsumexp(x, dim=-1, keepdim=True)


def chunk_rows(vocab: int, device: torch.device | str = "cpu") -> int:
    """Rows of a ``[rows, vocab]`` float32 block of about KL_CHUNK_ELEMENTS(_CPU) elements."""
    budget = KL_CHUNK_ELEMENTS_CPU if torch.device(device).type == "cpu" else KL_CHUNK_ELEMENTS
    return max(1, budget // max(1, vocab))


@dataclass
class TokenStats:
    """Per-position results for ``n`` positions of one sequence.

    stored:  ``[n, V]`` compressed log-probs (the storage form); ``None`` when scoring against a reference
    lognorm: float32 ``[n]``, logsumexp of the expanded stored log-probs (their renormalizer)
    nll:     float32 ``[n]``, -log p(next token), from full-precision log-probs
    argmax:  int64 ``[n]``, top-1 token, from full-precision logits
    kl:      float32 ``[n]``, KL(p_ref || p) when a reference was given, else ``None``
    """

    stored: Tensor | None
    lognorm: Tensor
    nll: Tensor
    argmax: Tensor
    kl: Tensor | None


def token_stats(
    logits: Tensor,
    targets: Tensor,
    ref_stored: Tensor | None = None,
    ref_lognorm: Tensor | None = None,
    *,
    dtype: torch.dtype = LOGPROB_DTYPE,
) -> TokenStats:
    """Everything scoring needs from the logits ``[n, V]`` of ``n`` positions of one sequence.

    The reference and every scored plan go through this one function, block by
    block of rows, so equal logits give bit-equal results. With a reference
    (``ref_stored`` ``[n, V]``, ``ref_lognorm`` ``[n]``, as this function returned
    them for the reference), both sides are compared in the same compressed,
    renormalized form ``float(stored) - lognorm``: an identity plan gives exactly 0
    since every term is ``p * (a - a)``. A KL below 0 (rounding of two nearly equal
    distributions; the true KL is >= 0) is clamped to 0.

    Cost per (position, vocab) element: two logsumexp-type passes, one exp on the
    reference side, an argmax and a few in-place elementwise passes; the reference's
    renormalizer is stored, not recomputed.
    """
    n, vocab = logits.shape
    dev = logits.device
    with_ref = ref_stored is not None
    if ref_stored is not None and (ref_lognorm is None or ref_stored.shape != logits.shape):
        raise ValueError(
            f"reference rows {tuple(ref_stored.shape)} (lognorm given: {ref_lognorm is not None}) "
            f"do not match logits {tuple(logits.shape)}"
        )
    store_dtype = ref_stored.dtype if ref_stored is not None else dtype
    step = chunk_rows(vocab, dev)
    rows = min(n, step)
    # the storage form is kept for a reference; when scoring, one chunk-sized buffer is reused
    stored = torch.empty((n if not with_ref else rows, vocab), dtype=store_dtype, device=dev)
    lognorm = torch.empty(n, dtype=torch.float32, device=dev)
    nll = torch.empty(n, dtype=torch.float32, device=dev)
    argmax = torch.empty(n, dtype=torch.int64, device=dev)
    kl = torch.empty(n, dtype=torch.float32, device=dev) if with_ref else None
    # Work buffers, allocated once: a fresh block per chunk costs an allocation (page faults) every time.
    work = torch.empty((rows, vocab), dtype=torch.float32, device=dev)
    ref_work = torch.empty((rows, vocab), dtype=torch.float32, device=dev) if with_ref else None
    targets = targets.to(dev)
    for s in range(0, n, step):
        e = min(s + step, n)
        chunk = logits[s:e].float()
        # .max(dim).indices is the first maximal index, as argmax, and about 3x cheaper on CPU
        argmax[s:e] = chunk.max(dim=-1).indices
        lp = torch.sub(chunk, torch.logsumexp(chunk, dim=-1, keepdim=True), out=work[: e - s])  # full precision
        nll[s:e] = -lp.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1)
        store = stored[s:e] if not with_ref else stored[: e - s]
        store.copy_(lp.clamp_min_(LOGPROB_FLOOR))  # compress (cast on copy)
        lq = lp.copy_(store)  # expand into the same buffer
        norm = torch.logsumexp(lq, dim=-1)
        lognorm[s:e] = norm
        if with_ref:
            assert ref_work is not None and kl is not None and ref_stored is not None and ref_lognorm is not None
            lq.sub_(norm.unsqueeze(-1))
            lr = ref_work[: e - s].copy_(ref_stored[s:e]).sub_(ref_lognorm[s:e].to(dev).unsqueeze(-1))
            diff = torch.sub(lr, lq, out=lq)  # log p_ref - log p_q
            kl[s:e] = lr.exp_().mul_(diff).sum(dim=-1)
    if kl is not None:
        kl.clamp_min_(0.0)
    return TokenStats(stored=None if with_ref else stored, lognorm=lognorm, nll=nll, argmax=argmax, kl=kl)


# ---------------------------------------------------------------------- reference cache


@dataclass
class ReferenceCache:
    """The unquantized model's next-token predictions on one evaluation set.

    input_ids:   int64 ``[S, L]``, the evaluation tokens (kept to check that a score uses the same ones)
    logprobs:    ``[S, L-1, V]`` in LOGPROB_DTYPE (or the dtype asked for): log p_ref at every predicted position
    lognorm:     float32 ``[S, L-1]``, logsumexp of ``logprobs`` in float32 (the renormalizer, see token_stats)
    nll:         float32 ``[S, L-1]``, -log p_ref(next token), from full-precision logits
    argmax:      int64 ``[S, L-1]``, the reference's top-1 token
    batch_size:  sequences per forward pass used; scoring reuses it for bit-identical batches
    model_sha:   content hash of the model the reference was computed with (``None``: unknown)
    eval_key:    key of the evaluation set (see :func:`eval_key_for`)
    """

    input_ids: Tensor
    logprobs: Tensor
    lognorm: Tensor
    nll: Tensor
    argmax: Tensor
    batch_size: int = DEFAULT_BATCH_SIZE
    model_sha: str | None = None
    eval_key: str | None = None

    @property
    def n_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.logprobs.shape[-1])

    @property
    def tokens(self) -> int:
        """Number of scored positions, S * (L - 1)."""
        return int(self.nll.numel())

    @property
    def ppl(self) -> float:
        """Perplexity of the reference model on the evaluation tokens."""
        return float(math.exp(float(self.nll.double().mean())))

    def check_tokens(self, input_ids: Tensor) -> None:
        """Raise :class:`ReferenceMismatch` unless ``input_ids`` are the tokens this cache was made from."""
        ids = as_token_batch(input_ids)
        if ids.shape != self.input_ids.shape or not torch.equal(ids, self.input_ids):
            raise ReferenceMismatch(
                f"the reference cache (eval set {self.eval_key or 'unnamed'}, shape "
                f"{tuple(self.input_ids.shape)}) was computed on other tokens than these (shape "
                f"{tuple(ids.shape)}); recompute the reference for this evaluation set"
            )

    def save(self, path: str | Path) -> Path:
        """Write as safetensors, whole or not at all (:func:`quantcore.files.write_whole`)."""
        from safetensors.torch import save_file

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "input_ids": self.input_ids.contiguous(),
            "logprobs": self.logprobs.contiguous(),
            "lognorm": self.lognorm.contiguous(),
            "nll": self.nll.contiguous(),
            "argmax": self.argmax.contiguous(),
        }
        meta = {
            "format": CACHE_FORMAT,
            "batch_size": str(self.batch_size),
            "model_sha": self.model_sha or "",
            "eval_key": self.eval_key or "",
        }
        from quantcore.files import write_whole

        return write_whole(p, lambda part: save_file(tensors, part, metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> ReferenceCache:
        """Read a cache written by :meth:`save` (safetensors only: no pickle is ever loaded)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        p = Path(path)
        if not p.is_file():
            raise ReferenceMismatch(
                f"no reference cache at {str(p)!r}; compute it with compute_reference first"
            )
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(p))
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ReferenceMismatch(
                f"reference cache {str(p)!r} is unreadable ({exc}); delete it and recompute"
            ) from exc
        if meta.get("format") != CACHE_FORMAT:
            raise ReferenceMismatch(
                f"reference cache {str(p)!r} has format {meta.get('format')!r}, expected {CACHE_FORMAT!r}; "
                "delete it and recompute"
            )
        missing = {"input_ids", "logprobs", "lognorm", "nll", "argmax"} - set(tensors)
        if missing:
            raise ReferenceMismatch(
                f"reference cache {str(p)!r} lacks {sorted(missing)}; delete it and recompute"
            )
        return cls(
            input_ids=tensors["input_ids"],
            logprobs=tensors["logprobs"],
            lognorm=tensors["lognorm"],
            nll=tensors["nll"],
            argmax=tensors["argmax"],
            batch_size=int(meta.get("batch_size", DEFAULT_BATCH_SIZE)),
            model_sha=meta.get("model_sha") or None,
            eval_key=meta.get("eval_key") or None,
        )


def eval_key_for(input_ids: Tensor) -> str:
    """A stable key of an evaluation token set: sha256 of its shape and int64 token ids (16 hex)."""
    ids = as_token_batch(input_ids)
    h = hashlib.sha256()
    h.update(f"{tuple(ids.shape)}".encode())
    h.update(ids.numpy().tobytes())
    return h.hexdigest()[:16]


def reference_cache_path(cache_root: str | Path, model_sha: str, eval_key: str) -> Path:
    """Where the reference of (model, evaluation set) lives: ``<root>/reference/<model_sha>/<eval_key>.safetensors``."""
    for what, value in (("model_sha", model_sha), ("eval_key", eval_key)):
        if not isinstance(value, str) or not _SAFE_KEY.match(value) or ".." in value:
            raise ValueError(
                f"{what} {value!r} cannot be used in a file name; use letters, digits, '.', '_' and '-' "
                "(a content hash, e.g. eval_key_for(input_ids))"
            )
    return Path(cache_root) / "reference" / model_sha / f"{eval_key}.safetensors"


def compute_reference(
    model: nn.Module,
    input_ids: Tensor,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
    model_sha: str | None = None,
    eval_key: str | None = None,
    logprob_dtype: torch.dtype = LOGPROB_DTYPE,
) -> ReferenceCache:
    """Run the unquantized model on ``input_ids`` ``[S, L]`` and keep what scoring needs.

    Returns a :class:`ReferenceCache` on the CPU (log-probs ``[S, L-1, V]`` in
    ``logprob_dtype``). Checks ``should_cancel`` between batches.
    """
    ids = as_token_batch(input_ids)
    n, length = ids.shape
    ranges = batch_ranges(n, batch_size)
    logprobs: Tensor | None = None  # allocated once the vocabulary size is known
    lognorm = torch.empty((n, length - 1), dtype=torch.float32)
    nll = torch.empty((n, length - 1), dtype=torch.float32)
    argmax = torch.empty((n, length - 1), dtype=torch.int64)
    for i, (s, e) in enumerate(ranges):
        check_cancel(should_cancel, f"computing the reference (batch {i + 1} of {len(ranges)})")
        logits = forward_logits(model, ids[s:e])  # [B, L, V]
        if logprobs is None:
            logprobs = torch.empty((n, length - 1, logits.shape[-1]), dtype=logprob_dtype)
        for j in range(e - s):
            st = token_stats(logits[j, :-1], ids[s + j, 1:], dtype=logprob_dtype)
            assert st.stored is not None  # no reference given: the storage form is returned
            logprobs[s + j] = st.stored.cpu()
            lognorm[s + j] = st.lognorm.cpu()
            nll[s + j] = st.nll.cpu()
            argmax[s + j] = st.argmax.cpu()
        del logits
        report_progress(progress, (i + 1) / len(ranges), f"reference: {e} of {n} sequences")
    assert logprobs is not None  # n >= 1 is checked by as_token_batch
    return ReferenceCache(
        input_ids=ids,
        logprobs=logprobs,
        lognorm=lognorm,
        nll=nll,
        argmax=argmax,
        batch_size=batch_size,
        model_sha=model_sha,
        eval_key=eval_key if eval_key is not None else eval_key_for(ids),
    )
