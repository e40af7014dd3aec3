"""The unquantized model's next-token predictions on an evaluation set, computed once and kept.

Reference
    The unquantized model run on the evaluation tokens. Its next-token
    log-probabilities are computed once per (model, evaluation set) by
    :func:`compute_reference` and kept in a :class:`ReferenceCache`, saved as
    safetensors in the artifact store (:func:`reference_cache_path`), so scoring many
    plans never recomputes them.

Two kinds
    ``full``: every log-prob, exact KL. ``topk``: the compact record of
    :mod:`quantcore.evaluation.compact` (top-k log-probs, tail mass, a tail sample: about
    1 KB a position), whose KL is an exact lower part plus an unbiased estimate of the
    divergence inside the tail, with a reported bound; the job picks ``topk`` where the
    full one would be large (Gemma 3's 262,144-token vocabulary: 512 KB a position).
    Logits reach this module a chunk of positions at a time
    (:func:`quantcore.evaluation.batches.iter_logits`), never ``[B, L, V]``.

Storage choice (kind ``full``)
    KL(p_ref || p_q) = sum_v p_ref(v) (log p_ref(v) - log p_q(v)) needs the *full*
    reference distribution at every position for an exact value. The cache
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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from quantcore.errors import QuantcoreError
from quantcore.evaluation.batches import (
    DEFAULT_BATCH_SIZE,
    LOGIT_CHUNK_ELEMENTS,
    Progress,
    ShouldCancel,
    as_token_batch,
    batch_ranges,
    check_cancel,
    iter_logits,
    report_progress,
)
from quantcore.evaluation.compact import (
    DEFAULT_TOPK,
    SAMPLE_SEED,
    CompactRows,
    reference_rows,
    score_rows,
)

CACHE_FORMAT = "quantplan.reference.v2"  # safetensors metadata tag; bump on any layout change
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


def logprob_at(logits: Tensor, index: Tensor) -> Tensor:
    """float32 log p(index) per row of logits ``[n, V]`` (``index`` ``[n]``), full precision; the reference and a
    scored plan compute it the same way, so equal logits give equal values."""
    x = logits.float()
    return x.gather(-1, index.to(x.device).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


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

KINDS = ("full", "topk")  # a cache's kind: full-vocabulary float16 log-probs, or the compact record


@dataclass
class ReferenceCache:
    """The unquantized model's next-token predictions on one evaluation set, of one of two kinds.

    Both kinds:

    input_ids:     int64 ``[S, L]``, the evaluation tokens (kept to check that a score uses the same ones)
    nll:           float32 ``[S, L-1]``, -log p_ref(next token), from full-precision logits
    argmax:        int64 ``[S, L-1]``, the reference's top-1 token
    top1_logprob:  float32 ``[S, L-1]``, log p_ref(argmax), full precision (the reference side of Δp)
    vocab:         the vocabulary size
    batch_size:    sequences per forward pass used; scoring reuses it for bit-identical batches
    model_sha:     content hash of the model the reference was computed with (``None``: unknown)
    eval_key:      key of the evaluation set (see :func:`eval_key_for`)
    recomputed:    True when it was computed for one job and not kept (too large for the cache)

    Kind ``full`` (:attr:`logprobs` set):

    logprobs:      ``[S, L-1, V]`` in LOGPROB_DTYPE (or the dtype asked for): log p_ref at every predicted position
    lognorm:       float32 ``[S, L-1]``, logsumexp of ``logprobs`` in float32 (the renormalizer, see token_stats)

    Kind ``topk`` (:attr:`compact` set): :class:`quantcore.evaluation.compact.CompactRows` with ``[S, L-1, ...]``
    tensors, the top-k log-probs, the tail mass and a tail sample (its module docstring says how a KL comes out of
    them, and what bound it carries).
    """

    input_ids: Tensor
    nll: Tensor
    argmax: Tensor
    top1_logprob: Tensor
    vocab: int
    logprobs: Tensor | None = None
    lognorm: Tensor | None = None
    compact: CompactRows | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    model_sha: str | None = None
    eval_key: str | None = None
    recomputed: bool = False  # computed for one job and not kept (a score then reports kind "recomputed")

    def __post_init__(self) -> None:
        if (self.logprobs is None) == (self.compact is None):
            raise ValueError("a reference cache holds either full log-probs or a compact record, exactly one")
        if self.logprobs is not None and self.lognorm is None:
            raise ValueError("a full reference cache needs its lognorm")

    @property
    def kind(self) -> str:
        """``full`` (every log-prob, float16) or ``topk`` (the compact record)."""
        return "full" if self.logprobs is not None else "topk"

    @property
    def reported_kind(self) -> str:
        """What a score says it was scored against: :attr:`kind`, or ``recomputed`` for a reference not kept."""
        return "recomputed" if self.recomputed else self.kind

    @property
    def topk(self) -> int | None:
        """Tokens kept per position in a compact cache; None for a full one."""
        return int(self.compact.topk_ids.shape[-1]) if self.compact is not None else None

    @property
    def n_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def tokens(self) -> int:
        """Number of scored positions, S * (L - 1)."""
        return int(self.nll.numel())

    @property
    def ppl(self) -> float:
        """Perplexity of the reference model on the evaluation tokens."""
        return float(math.exp(float(self.nll.double().mean())))

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the cache file holds (about its size on disk)."""
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def rows(self, seq: int, start: int, end: int) -> CompactRows:
        """The compact record of positions ``start:end`` of sequence ``seq`` (kind ``topk`` only)."""
        c = self.compact
        assert c is not None, "rows() reads a compact reference"
        return CompactRows(*(getattr(c, f.name)[seq, start:end] for f in fields(CompactRows)))

    def check_tokens(self, input_ids: Tensor) -> None:
        """Raise :class:`ReferenceMismatch` unless ``input_ids`` are the tokens this cache was made from."""
        ids = as_token_batch(input_ids)
        if ids.shape != self.input_ids.shape or not torch.equal(ids, self.input_ids):
            raise ReferenceMismatch(
                f"the reference cache (eval set {self.eval_key or 'unnamed'}, shape "
                f"{tuple(self.input_ids.shape)}) was computed on other tokens than these (shape "
                f"{tuple(ids.shape)}); recompute the reference for this evaluation set"
            )

    def _tensors(self) -> dict[str, Tensor]:
        tensors = {"input_ids": self.input_ids, "nll": self.nll, "argmax": self.argmax,
                   "top1_logprob": self.top1_logprob}
        if self.logprobs is not None and self.lognorm is not None:
            tensors.update(logprobs=self.logprobs, lognorm=self.lognorm)
        if self.compact is not None:
            tensors.update({f.name: getattr(self.compact, f.name) for f in fields(CompactRows)})
        return {k: v.contiguous() for k, v in tensors.items()}

    def save(self, path: str | Path) -> Path:
        """Write as safetensors, whole or not at all (:func:`quantcore.files.write_whole`)."""
        from safetensors.torch import save_file

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tensors = self._tensors()
        meta = {
            "format": CACHE_FORMAT,
            "kind": self.kind,
            "vocab": str(self.vocab),
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
        kind = meta.get("kind")
        need = {"input_ids", "nll", "argmax", "top1_logprob"} | (
            {"logprobs", "lognorm"} if kind == "full" else {f.name for f in fields(CompactRows)})
        missing = need - set(tensors)
        if kind not in KINDS or missing:
            raise ReferenceMismatch(
                f"reference cache {str(p)!r} (kind {kind!r}) lacks {sorted(missing)}; delete it and recompute"
            )
        compact = (CompactRows(**{f.name: tensors[f.name] for f in fields(CompactRows)})
                   if kind == "topk" else None)
        return cls(
            input_ids=tensors["input_ids"],
            nll=tensors["nll"],
            argmax=tensors["argmax"],
            top1_logprob=tensors["top1_logprob"],
            vocab=int(meta.get("vocab", 0)),
            logprobs=tensors.get("logprobs") if kind == "full" else None,
            lognorm=tensors.get("lognorm") if kind == "full" else None,
            compact=compact,
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


def model_vocab(model: nn.Module) -> int:
    """Vocabulary size of a causal LM: its output embedding's rows, else its (text) config's ``vocab_size``."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    rows = getattr(head, "out_features", None)
    if isinstance(rows, int) and rows > 0:
        return rows
    config: Any = cast(Any, model).config
    return int(config.get_text_config().vocab_size)


def full_cache_bytes(sequences: int, length: int, vocab: int, logprob_dtype: torch.dtype = LOGPROB_DTYPE) -> int:
    """Bytes of a full-vocabulary reference of ``sequences`` x ``length`` tokens (its log-probs; the rest is small)."""
    return sequences * (length - 1) * vocab * torch.empty((), dtype=logprob_dtype).element_size()


# the compact reference keeps k = vocab / 256 tokens a position (at least 64, at most the setting): 8 (k + k) bytes
# against 2 V, about 3 % of the full record whatever the vocabulary. Measured on gemma-3-270m (docs/concepts/
# scoring.md): k = 64 leaves a bound of 7.9 % of the KL mean at 8 x 128 tokens, k = 1024 (its V / 256) 0.7 %.
MIN_TOPK = 64
VOCAB_PER_TOPK = 256


def compact_topk(vocab: int, topk: int = DEFAULT_TOPK) -> int:
    """Tokens a position the compact reference of a ``vocab``-token model keeps: ``vocab // 256``, at least
    :data:`MIN_TOPK` (or ``topk`` where that is less) and at most ``topk`` (the setting)."""
    return max(1, min(topk, max(MIN_TOPK, vocab // VOCAB_PER_TOPK), vocab))


def choose_topk(sequences: int, length: int, vocab: int, *, full_max_bytes: int, topk: int = DEFAULT_TOPK,
                ) -> int | None:
    """The kind of reference to keep: None (full vocabulary, exact) when its log-probs fit in ``full_max_bytes``,
    else the compact record of :mod:`quantcore.evaluation.compact` with :func:`compact_topk` tokens a position
    (``topk``: the most)."""
    return None if full_cache_bytes(sequences, length, vocab) <= full_max_bytes else compact_topk(vocab, topk)


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
    topk: int | None = None,
    tail_samples: int | None = None,
    chunk_elements: int = LOGIT_CHUNK_ELEMENTS,
) -> ReferenceCache:
    """Run the unquantized model on ``input_ids`` ``[S, L]`` and keep what scoring needs.

    topk: None keeps every log-prob (kind ``full``, ``[S, L-1, V]`` in ``logprob_dtype``); a number keeps the
        compact record (kind ``topk``: that many top tokens and ``tail_samples`` tail tokens a position, by default
        as many as ``topk``: the bound shrinks as 1 / sqrt(tail_samples) and with the tail mass past the top k).
    chunk_elements: logits exist a chunk of about this many float32 elements at a time
        (:func:`quantcore.evaluation.batches.iter_logits`); scoring must use the same to stay bit-exact.

    Returns a :class:`ReferenceCache` on the CPU. Checks ``should_cancel`` between batches.
    """
    from quantcore.algorithms.apply import check_intact

    check_intact(model)  # a model whose weights a plan rounded in place is no reference
    ids = as_token_batch(input_ids)
    n, length = ids.shape
    if topk is not None and topk < 1:
        raise ValueError(f"topk must be >= 1 (or None for the full vocabulary), got {topk}")
    ranges = batch_ranges(n, batch_size)
    vocab = model_vocab(model)
    full = topk is None
    m = (topk or 0) if tail_samples is None else tail_samples
    logprobs = torch.empty((n, length - 1, vocab), dtype=logprob_dtype) if full else None
    lognorm = torch.empty((n, length - 1), dtype=torch.float32) if full else None
    compact: CompactRows | None = None
    if not full:
        assert topk is not None
        k = min(topk, vocab)
        compact = CompactRows(
            topk_ids=torch.empty((n, length - 1, k), dtype=torch.int32),
            topk_logprobs=torch.empty((n, length - 1, k), dtype=torch.float32),
            tail_logmass=torch.empty((n, length - 1), dtype=torch.float32),
            sample_ids=torch.empty((n, length - 1, m), dtype=torch.int32),
            sample_logprobs=torch.empty((n, length - 1, m), dtype=torch.float32),
        )
    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    nll = torch.empty((n, length - 1), dtype=torch.float32)
    argmax = torch.empty((n, length - 1), dtype=torch.int64)
    top1 = torch.empty((n, length - 1), dtype=torch.float32)
    for i, (s, e) in enumerate(ranges):
        check_cancel(should_cancel, f"computing the reference (batch {i + 1} of {len(ranges)})")
        for j, a, b, logits in iter_logits(model, ids[s:e], chunk_elements=chunk_elements):
            row, targets = s + j, ids[s + j, a + 1:b + 1]
            if logprobs is not None and lognorm is not None:
                st = token_stats(logits, targets, dtype=logprob_dtype)
                assert st.stored is not None  # no reference given: the storage form is returned
                logprobs[row, a:b] = st.stored.cpu()
                lognorm[row, a:b] = st.lognorm.cpu()
                nll[row, a:b], argmax[row, a:b] = st.nll.cpu(), st.argmax.cpu()
                top1[row, a:b] = logprob_at(logits, st.argmax).cpu()
            else:
                assert compact is not None and topk is not None
                got = reference_rows(logits, targets, topk=topk, tail_samples=m, generator=generator,
                                     block=chunk_rows(vocab, logits.device))
                assert got.rows is not None
                nll[row, a:b], argmax[row, a:b], top1[row, a:b] = got.nll.cpu(), got.argmax.cpu(), got.picked.cpu()
                for f in fields(CompactRows):
                    getattr(compact, f.name)[row, a:b] = getattr(got.rows, f.name).cpu()
        report_progress(progress, (i + 1) / len(ranges), f"reference: {e} of {n} sequences")
    return ReferenceCache(
        input_ids=ids,
        nll=nll,
        argmax=argmax,
        top1_logprob=top1,
        vocab=vocab,
        logprobs=logprobs,
        lognorm=lognorm,
        compact=compact,
        batch_size=batch_size,
        model_sha=model_sha,
        eval_key=eval_key if eval_key is not None else eval_key_for(ids),
    )


@dataclass
class RowComparison:
    """A scored plan against the reference on positions ``start:end`` of one sequence (float32 ``[n]`` each).

    kl:       KL(p_ref || p_q): exact against a full reference, the estimate against a compact one
    kl_lower: the exact part of a compact estimate (a lower bound of the KL); equals ``kl`` against a full one
    tail_var: variance of a compact estimate's sampled part (0 against a full one)
    nll:      -log p_q(next token)
    agree:    bool, the plan's top-1 token equals the reference's
    dp:       p_q(reference's top-1) - p_ref(reference's top-1)
    """

    kl: Tensor
    kl_lower: Tensor
    tail_var: Tensor
    nll: Tensor
    agree: Tensor
    dp: Tensor


def compare_rows(reference: ReferenceCache, seq: int, start: int, end: int, logits: Tensor, targets: Tensor,
                 ) -> RowComparison:
    """Compare a plan's logits ``[end - start, V]`` of sequence ``seq`` with the reference at those positions
    (``targets``: the next tokens). Full reference: :func:`token_stats`; compact:
    :func:`quantcore.evaluation.compact.score_rows`. Either way an identity plan's logits give exactly 0 KL and
    Δp, full agreement and the reference's NLL."""
    ref_argmax = reference.argmax[seq, start:end]
    ref_top1 = reference.top1_logprob[seq, start:end]
    if reference.logprobs is not None and reference.lognorm is not None:
        st = token_stats(logits, targets, reference.logprobs[seq, start:end], reference.lognorm[seq, start:end])
        assert st.kl is not None
        kl = st.kl.cpu()
        nll, best = st.nll.cpu(), st.argmax.cpu()
        q_top1 = logprob_at(logits, ref_argmax).cpu()
        return RowComparison(kl=kl, kl_lower=kl, tail_var=torch.zeros_like(kl), nll=nll, agree=best == ref_argmax,
                             dp=q_top1.exp() - ref_top1.exp())
    got = score_rows(logits, targets, ref_argmax, reference.rows(seq, start, end),
                     block=chunk_rows(logits.shape[-1], logits.device))
    assert got.kl is not None and got.kl_lower is not None and got.tail_var is not None
    return RowComparison(kl=got.kl.cpu(), kl_lower=got.kl_lower.cpu(), tail_var=got.tail_var.cpu(),
                         nll=got.nll.cpu(), agree=got.argmax.cpu() == ref_argmax,
                         dp=got.picked.cpu().exp() - ref_top1.exp())
