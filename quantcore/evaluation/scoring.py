"""Score a quantization plan against the unquantized model: KL, top-1 agreement, perplexity.

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
    ``tests/quantcore/test_scoring.py::test_float16_compression_error_is_small``.
    Pass ``logprob_dtype=torch.float32`` to :func:`compute_reference` for an
    uncompressed cache.

    NLL and argmax are computed from the full-precision logits on both sides, so
    perplexities and top-1 agreement carry no compression error at all.

Exactness
    Scoring runs the evaluation tokens in the same batches as the reference
    (``batch_size`` defaults to the reference's own), so an identity plan repeats the
    reference computation operation for operation.

Evaluation tokens are a LongTensor ``[S, L]``: S sequences of L tokens, no padding
(``quantcore.evaluation.text`` chunks the evaluation text that way). Position ``t`` of a
sequence predicts token ``t + 1``; the L - 1 predicted positions of each sequence
are scored.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from quantcore.errors import Cancelled, PlanError, QuantcoreError, name_list
from quantcore.schemes.specs import NUMERICS, Scheme, get_scheme

if TYPE_CHECKING:
    from quantcore.algorithms.awq import AwqResult
    from quantcore.models.parallel import Parallelism

Progress = Callable[[float, str], None]
ShouldCancel = Callable[[], bool]

CACHE_FORMAT = "quantplan.reference.v1"  # safetensors metadata tag; bump on any layout change
LOGPROB_DTYPE = torch.float16  # storage dtype of the reference log-probs (see module docstring)
# log-probs are clamped here before the float16 cast: float16 overflows to -inf below
# -65504, and -inf - -inf = nan in the KL; exp(-1e4) is exactly 0 in float32 anyway.
LOGPROB_FLOOR = -1.0e4
DEFAULT_BATCH_SIZE = 4  # sequences per forward pass
DEFAULT_POSITION_BUCKETS = 8  # equal-width buckets of the position in the sequence
# logits are processed a block of rows at a time, which bounds the temporaries: on a GPU ~4M elements
# (16 MB fp32) per block; on a CPU 256K (1 MB), so that the ten-odd passes over a block stay in the
# core's L2 cache (measured on SmolLM2's 49k vocabulary: 30 % less time than 16 MB blocks). The
# results are the same for any block size: every reduction runs along one row.
KL_CHUNK_ELEMENTS = 1 << 22
KL_CHUNK_ELEMENTS_CPU = 1 << 18
# KL histogram edges (nats): 0, then 1e-6 .. 1e2 at 4 bins per decade; KL >= 1e2 counts in the last bin.
KL_HIST_EDGES: tuple[float, ...] = (0.0, *(10.0 ** (k / 4) for k in range(-24, 9)))
# a static scale that clips more than this share of a layer's inputs gets a note in the report; below
# it, clipping is the drift of upstream quantization error past the calibrated max, not a bad calibration
SATURATION_NOTE = 1e-3
_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ReferenceMismatch(QuantcoreError, ValueError):
    """The reference cache does not belong to these evaluation tokens or this model."""


# ---------------------------------------------------------------------- progress / cancel


def check_cancel(should_cancel: ShouldCancel | None, what: str) -> None:
    """Raise :class:`Cancelled` (message names ``what``) when ``should_cancel()`` is true."""
    if should_cancel is not None and should_cancel():
        raise Cancelled(f"{what} was cancelled")


def report_progress(progress: Progress | None, fraction: float, message: str) -> None:
    """Call ``progress(fraction, message)`` with the fraction clamped to [0, 1]."""
    if progress is not None:
        progress(min(max(fraction, 0.0), 1.0), message)


# ---------------------------------------------------------------------- model plumbing


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


# ---------------------------------------------------------------------- log-prob compression


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
    if with_ref and (ref_lognorm is None or ref_stored.shape != logits.shape):
        raise ValueError(
            f"reference rows {tuple(ref_stored.shape)} (lognorm given: {ref_lognorm is not None}) "
            f"do not match logits {tuple(logits.shape)}"
        )
    store_dtype = ref_stored.dtype if with_ref else dtype
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
            assert ref_work is not None and kl is not None
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


# ---------------------------------------------------------------------- the report

@dataclass
class ScoreReport:
    """How far a quantized model's next-token distributions are from the reference.

    kl_mean, kl_p50, kl_p90, kl_p99, kl_max: per-token KL(p_ref || p_quant) in nats
    top1_agree:     share of positions whose argmax token equals the reference's
    ppl_ref, ppl:   perplexity of the reference and of the quantized model
    tokens:         number of scored positions
    kl_by_position: ``[{bucket_start, bucket_end, kl_mean}]``, positions in the sequence, end exclusive
    kl_hist:        ``{edges: [...], counts: [...]}`` on KL_HIST_EDGES (first bin holds exact zeros)
    act_saturation: ``{layer: fraction of input elements clipped}`` for layers with static
                    (calibrated) activation scales: a static scale that clips live traffic shows here
    kv_cache:       the KV cache format scored (:mod:`quantcore.evaluation.kvcache`; ``AUTO``: not quantized)
    kv_saturation:  ``{attention layer: fraction of K and V elements clipped}`` under that format
    notes:          messages for people about how the plan was applied (e.g. smoothing skipped)
    numerics:       :data:`quantcore.schemes.specs.NUMERICS` of the quantcore that scored it (1 when a stored report
                    has none)
    """

    kl_mean: float
    kl_p50: float
    kl_p90: float
    kl_p99: float
    kl_max: float
    top1_agree: float
    ppl_ref: float
    ppl: float
    tokens: int
    kl_by_position: list[dict[str, float]] = field(default_factory=list)
    kl_hist: dict[str, list[float]] = field(default_factory=dict)
    act_saturation: dict[str, float] = field(default_factory=dict)
    kv_cache: str = "AUTO"
    kv_saturation: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    numerics: int = NUMERICS

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (floats, ints, lists); :meth:`from_dict` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScoreReport:
        return cls(**{"numerics": 1, **{k: data[k] for k in cls.__dataclass_fields__ if k in data}})


def summarize(
    kl: Tensor,
    agree: Tensor,
    nll: Tensor,
    nll_ref: Tensor,
    *,
    position_buckets: int = DEFAULT_POSITION_BUCKETS,
) -> ScoreReport:
    """Build a :class:`ScoreReport` from per-position arrays, all ``[S, L-1]``.

    kl: KL per position; agree: bool, top-1 equal; nll / nll_ref: -log p(next token).
    """
    kl_np = kl.detach().double().cpu().numpy()
    flat = kl_np.reshape(-1)
    width = kl_np.shape[1]
    n_buckets = max(1, min(position_buckets, width))
    edges = np.unique(np.linspace(0, width, n_buckets + 1).round().astype(int))
    by_pos = [
        {"bucket_start": int(a), "bucket_end": int(b), "kl_mean": float(kl_np[:, a:b].mean())}
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    hist_edges = np.asarray(KL_HIST_EDGES)
    counts, _ = np.histogram(np.clip(flat, 0.0, hist_edges[-1]), bins=hist_edges)
    p50, p90, p99 = np.quantile(flat, [0.5, 0.9, 0.99])
    return ScoreReport(
        kl_mean=float(flat.mean()),
        kl_p50=float(p50),
        kl_p90=float(p90),
        kl_p99=float(p99),
        kl_max=float(flat.max()),
        top1_agree=float(agree.double().mean()),
        ppl_ref=float(math.exp(float(nll_ref.double().mean()))),
        ppl=float(math.exp(float(nll.double().mean()))),
        tokens=int(flat.size),
        kl_by_position=by_pos,
        kl_hist={"edges": [float(x) for x in hist_edges], "counts": [int(c) for c in counts]},
    )


# ---------------------------------------------------------------------- applying a plan


def _as_schemes(plan: Mapping[str, Scheme | str]) -> dict[str, Scheme]:
    out: dict[str, Scheme] = {}
    for layer, s in plan.items():
        if isinstance(s, str):
            try:
                s = get_scheme(s)
            except (KeyError, ValueError) as exc:
                raise PlanError(f"layer {layer!r}: {exc}") from exc
        out[layer] = s
    return out


def _to_tensor(x: Any) -> Tensor:
    return (
        x.detach().float().cpu()
        if isinstance(x, Tensor)
        else torch.as_tensor(np.asarray(x), dtype=torch.float32)
    )


@dataclass
class AppliedContext:
    """What :func:`plan_applied` did to the model.

    handle:    the handle ``quantcore.algorithms.apply.apply_plan`` returned
    smoothing: ``{layer: [K] factor s}`` of every layer whose input was divided by s
    notes:     messages for people, e.g. a layer whose scheme asks for SmoothQuant that
               could not be smoothed exactly (it is quantized unsmoothed)
    """

    handle: Any
    smoothing: dict[str, Tensor] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@contextmanager
def plan_applied(
    model: nn.Module,
    plan: Mapping[str, Scheme | str],
    *,
    act_amax: Mapping[str, float] | None = None,
    act_channel_max: Mapping[str, Any] | None = None,
    before_quantize: Callable[[nn.Module], None] | None = None,
    track_saturation: bool = False,
    weight_hessians: Mapping[str, Tensor] | None = None,
    gptq_cache: dict[str, Tensor] | None = None,
    awq: AwqResult | None = None,
    parallel: Parallelism | None = None,
) -> Iterator[AppliedContext]:
    """Smooth (where a scheme has a SmoothQuant alpha) and fake-quantize ``model`` for the block.

    On exit — normal, error or cancel — the plan and the smoothing are undone in
    reverse order and the model's weights are bit-identical to before.

    act_channel_max: ``{layer: [K] max |x_j| per input channel}`` from calibration,
        needed by every layer whose scheme smooths.
    act_amax: ``{layer: max |x|}`` from calibration, needed by static activation
        scales. For a smoothed layer the static amax of its *smoothed* input is
        derived exactly from the channel maxima and the factors,
        ``max_j(channel_max_j / s_j)``, since calibration saw the unsmoothed input.
    before_quantize: called with the model after smoothing, just before fake
        quantization (the sensitivity sweep keeps the unquantized weights there).
    track_saturation: count clipped activations of layers with static scales
        (``ctx.handle.stats()``); dynamic scales cannot clip, so they are never tracked.
    weight_hessians: ``{layer: Hessian}`` of the unsmoothed inputs, needed by every layer whose
        scheme rounds with GPTQ (:func:`quantcore.algorithms.gptq.collect_hessians`).
    gptq_cache: see :func:`quantcore.algorithms.apply.apply_plan`.
    awq: the factors :func:`quantcore.algorithms.awq.awq_search` found for the layers whose scheme scales with AWQ
        (needed when there are any); they are folded after SmoothQuant's, before rounding. A layer the
        search skipped is rounded unscaled, with a note.
    parallel: the GPUs the plan is served on: row-parallel layers take their dynamic activation scales over
        each GPU's share of the input (see :func:`quantcore.algorithms.apply.apply_plan`); None: one GPU.

    Yields an :class:`AppliedContext`.
    """
    from quantcore.algorithms.apply import apply_plan

    schemes = _as_schemes(plan)
    alphas = {
        layer: float(s.smoothquant_alpha)
        for layer, s in schemes.items()
        if s.smoothquant_alpha is not None and not s.is_identity
    }
    if alphas:
        missing = [layer for layer in alphas if act_channel_max is None or layer not in act_channel_max]
        if missing:
            raise PlanError(
                f"SmoothQuant needs calibrated per-channel activation maxima for {len(missing)} layer(s) "
                f"({name_list(missing)}); run a calibration job for "
                "this model first, or choose schemes without SmoothQuant for these layers"
            )
    awq_layers = [layer for layer, s in schemes.items() if s.needs_awq]
    if awq_layers and awq is None:
        raise PlanError(
            f"AWQ scales the inputs of {name_list(awq_layers)} by factors searched on calibration text: run "
            "quantcore.algorithms.awq.awq_search first, or choose a scheme without AWQ"
        )
    smoothing = None
    awq_folds = None
    applied = None
    try:
        amax = dict(act_amax) if act_amax is not None else None
        if alphas:
            from quantcore.algorithms.smoothquant import smooth_model

            assert act_channel_max is not None  # checked above
            try:
                smoothing = smooth_model(
                    model, {k: act_channel_max[k] for k in alphas}, alphas, layers=list(alphas)
                )
            except PlanError:
                raise
            except ValueError as exc:  # e.g. one fusion group asked for two alphas
                raise PlanError(f"SmoothQuant cannot be applied as planned: {exc}") from exc
            if amax is not None:
                for layer, s in smoothing.factors.items():
                    if layer in amax and layer in act_channel_max:
                        cm = _to_tensor(act_channel_max[layer])
                        amax[layer] = float((cm / _to_tensor(s)).max())
        awq_notes = []
        if awq_layers:
            from quantcore.algorithms.smoothquant import fold_factors

            assert awq is not None
            found = {layer: awq.factors[layer] for layer in awq_layers if layer in awq.factors}
            why: dict[str, list[str]] = {}  # one note per reason, however many layers share it
            for layer in awq_layers:
                if layer not in found:
                    why.setdefault(awq.skipped.get(layer, "no factors were searched for it"), []).append(layer)
            awq_notes = [
                f"AWQ not applied to {len(layers)} layer(s) ({name_list(layers, 3)}): {reason}; rounded to nearest "
                "unscaled"
                for reason, layers in why.items()
            ]
            if found:
                awq_folds = fold_factors(model, found)
        if before_quantize is not None:
            before_quantize(model)
        static = any(s.activations is not None and not s.activations.dynamic for s in schemes.values())
        hessians = weight_hessians
        if smoothing is not None and weight_hessians is not None:
            from quantcore.algorithms.apply import gptq_hessians

            hessians = gptq_hessians(schemes, weight_hessians, smoothing.factors, rounded=gptq_cache or ())
        applied = apply_plan(model, schemes, act_amax=amax, track_stats=track_saturation and static,
                             weight_hessians=hessians, gptq_cache=gptq_cache, parallel=parallel)
        unsmoothed: dict[str, list[str]] = {}  # one note per reason, however many layers share it (MoE experts)
        for layer, reason in (smoothing.skipped.items() if smoothing is not None else ()):
            unsmoothed.setdefault(reason, []).append(layer)
        notes = [
            f"{layers[0]}: SmoothQuant not applied ({reason}); the layer is quantized unsmoothed" if len(layers) == 1
            else f"{len(layers)} layers ({name_list(layers, 3)}): SmoothQuant not applied ({reason}); they are "
                 "quantized unsmoothed"
            for reason, layers in unsmoothed.items()
        ] + awq_notes
        yield AppliedContext(
            handle=applied, smoothing=dict(smoothing.factors) if smoothing is not None else {}, notes=notes
        )
    finally:
        if applied is not None:
            applied.restore()
        if awq_folds is not None:
            awq_folds.restore()
        if smoothing is not None:
            smoothing.restore()


# ---------------------------------------------------------------------- scoring


def calibrate_kv_cache(
    model: nn.Module,
    plan: Mapping[str, Scheme | str],
    input_ids: Tensor,
    *,
    act_amax: Mapping[str, float] | None = None,
    act_channel_max: Mapping[str, Any] | None = None,
    batch_size: int = 4,
    should_cancel: ShouldCancel | None = None,
    weight_hessians: Mapping[str, Tensor] | None = None,
    awq: AwqResult | None = None,
    gptq_cache: dict[str, Tensor] | None = None,
    parallel: Parallelism | None = None,
) -> Any:
    """Per attention layer max |K| and |V| on calibration tokens, with ``plan`` applied as it will be
    served (K and V come out of the quantized k_proj / v_proj): what calibrated KV cache scales
    (amax / 448) are made of; |Q| is recorded too. Returns a :class:`quantcore.evaluation.kvcache.KvAmax`.
    ``gptq_cache``: see :func:`score_plan` (the score that follows reuses its GPTQ-rounded weights); ``parallel``:
    the GPUs the plan is served on (see :func:`plan_applied`)."""
    from quantcore.evaluation.kvcache import kv_amax_observed

    ids = as_token_batch(input_ids)
    ranges = batch_ranges(ids.shape[0], batch_size)
    with plan_applied(model, plan, act_amax=act_amax, act_channel_max=act_channel_max,
                      weight_hessians=weight_hessians, awq=awq, gptq_cache=gptq_cache, parallel=parallel), \
            kv_amax_observed(model) as amax:
        for i, (s, e) in enumerate(ranges):
            check_cancel(should_cancel, f"KV cache calibration (batch {i + 1} of {len(ranges)})")
            forward_logits(model, ids[s:e])
    return amax


def _clipping_note(saturation: Mapping[str, float], template: str) -> str | None:
    """``template`` filled with how many layers clipped more than :data:`SATURATION_NOTE` of their elements
    (``n``), the worst of them (``worst``) and its share (``share``); None when none did."""
    clipped = {k: v for k, v in saturation.items() if v > SATURATION_NOTE}
    if not clipped:
        return None
    worst = max(clipped, key=clipped.__getitem__)
    return template.format(n=len(clipped), worst=worst, share=clipped[worst])


def score_plan(
    model: nn.Module,
    plan: Mapping[str, Scheme | str],
    input_ids: Tensor,
    reference: ReferenceCache,
    *,
    act_amax: Mapping[str, float] | None = None,
    act_channel_max: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    position_buckets: int = DEFAULT_POSITION_BUCKETS,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
    kv_cache: str | None = None,
    kv_amax: Any = None,
    kv_skip: Sequence[str] = (),
    weight_hessians: Mapping[str, Tensor] | None = None,
    awq: AwqResult | None = None,
    gptq_cache: dict[str, Tensor] | None = None,
    parallel: Parallelism | None = None,
) -> ScoreReport:
    """Score ``plan`` (``{layer: Scheme}``) on ``input_ids`` ``[S, L]`` against ``reference``.

    Applies smoothing and the plan, runs the evaluation tokens batch by batch
    (``batch_size`` defaults to the reference's, which keeps an identity plan
    bit-identical to the reference), and restores the model exactly afterwards, also
    on error or cancel. Layers missing from ``plan`` stay unquantized.

    kv_cache: a KV cache format (:mod:`quantcore.evaluation.kvcache`) to store K and V in as well; a calibrated
        one (``FP8``) needs ``kv_amax`` (:func:`calibrate_kv_cache`).
    kv_skip: a plan's ``kv_cache_skip`` entries (decoder layer indices, ``"sliding_window"``): those
        attention layers keep the model's dtype (:func:`quantcore.evaluation.kvcache.kv_skip_layers`).
    weight_hessians: ``{layer: Hessian}`` for the layers whose scheme rounds with GPTQ (see :func:`plan_applied`).
    awq: AWQ's factors for the layers whose scheme scales with AWQ (see :func:`plan_applied`).
    gptq_cache: GPTQ-rounded weights to reuse and fill (see :func:`quantcore.algorithms.apply.apply_plan`): the same dict
        given to :func:`calibrate_kv_cache` before rounds each GPTQ layer once for both.
    parallel: the GPUs the plan is served on (a plan's ``tensor_parallel``, ``expert_parallel``): row-parallel
        layers quantize each GPU's share of their input on its own dynamic scale (see :func:`plan_applied`).
    """
    from quantcore.evaluation.kvcache import (
        attention_modules,
        get_kv_format,
        kv_cache_quantized,
        kv_skip_layers,
    )
    from quantcore.models.checkpoint import attention_windows

    kv = get_kv_format(kv_cache)
    skip = (kv_skip_layers(kv_skip, attention_modules(model), attention_windows(model))
            if kv_skip and not kv.is_identity else set())
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    static_layers = {
        layer
        for layer, sc in _as_schemes(plan).items()
        if sc.activations is not None and not sc.activations.dynamic
    }
    bs = reference.batch_size if batch_size is None else batch_size
    ranges = batch_ranges(ids.shape[0], bs)
    kl = torch.empty_like(reference.nll)
    nll = torch.empty_like(reference.nll)
    agree = torch.empty(reference.nll.shape, dtype=torch.bool)
    with plan_applied(
        model, plan, act_amax=act_amax, act_channel_max=act_channel_max, track_saturation=True,
        weight_hessians=weight_hessians, awq=awq, gptq_cache=gptq_cache, parallel=parallel,
    ) as ctx, kv_cache_quantized(model, kv, amax=kv_amax, skip=skip) as kv_ctx:
        for i, (s, e) in enumerate(ranges):
            check_cancel(should_cancel, f"scoring (batch {i + 1} of {len(ranges)})")
            logits = forward_logits(model, ids[s:e])
            for j in range(e - s):
                st = token_stats(
                    logits[j, :-1], ids[s + j, 1:], reference.logprobs[s + j], reference.lognorm[s + j]
                )
                assert st.kl is not None
                kl[s + j] = st.kl.cpu()
                nll[s + j] = st.nll.cpu()
                agree[s + j] = st.argmax.cpu() == reference.argmax[s + j]
            del logits
            report_progress(progress, (i + 1) / len(ranges), f"scoring: {e} of {ids.shape[0]} sequences")
        saturation = {
            layer: st.activations.saturation
            for layer, st in ctx.handle.stats().items()
            if layer in static_layers and st.activations is not None and st.activations.n_elements > 0
        }
    report = summarize(kl, agree, nll, reference.nll, position_buckets=position_buckets)
    report.act_saturation = saturation
    report.kv_cache = kv.name
    report.kv_saturation = kv_ctx.saturation
    report.notes = list(ctx.notes)
    if kv.attention:
        fix = ("calibrate on text like this for K and V" if kv.calibrated else
               "calibrated K/V scales (kv_cache FP8_ATTN) avoid K/V clipping")
        fix += "; Q runs at scale 1.0 in vLLM's FP8 attention"
    else:
        fix = ("calibrate on text like this" if kv.calibrated else
               "calibrated K/V scales (kv_cache FP8) or FP8_E5M2 avoid this")
    what = "Q, K or V" if kv.attention else "K or V"
    for note in (_clipping_note(report.kv_saturation, f"the {kv.name} KV cache clipped {what} in {{n}} attention "
                                f"layer(s), worst {{worst}} ({{share:.3%}} of its elements): {fix}"),
                 _clipping_note(saturation, "static activation scales clipped live traffic in {n} layer(s), worst "
                                "{worst} ({share:.3%} of its inputs): the calibration text did not cover this text's "
                                "range; calibrate on text like this, or use dynamic scales for these layers")):
        if note:
            report.notes.append(note)
    return report
