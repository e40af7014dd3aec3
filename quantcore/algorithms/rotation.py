"""Hadamard rotations folded into a model: R1 (residual stream), R2 (per attention head), R4 (online, down_proj).

For any orthogonal Q, ``x Wᵀ = (x Q)(W Q)ᵀ``: a linear whose input is rotated by Q computes the same output when its
weight is rotated by Q too. QuaRot and SpinQuant (SpinQuant's names R1 to R4) use it to spread an outlier channel's
magnitude over every channel before quantization; the full-precision model is unchanged. Folds (Hugging Face
Llama / Mistral / Qwen2 / Gemma naming, from :mod:`quantcore.models.architectures`):

==========  ==========================================================================================================
R1          The residual stream is carried rotated, ``h' = h Q₁``. First every RMSNorm's gain g is folded into the
            linears it feeds (``W[:, j] *= g_j``, the gain set neutral: 1, or 0 for Gemma's ``(1 + w)``), since
            ``rms(x Q) = rms(x)`` holds for a neutral norm only; then the embedding ``E Q₁``, every block's input
            projections (q/k/v, gate/up) and the head ``W Q₁``, its output projections (o_proj, down_proj)
            ``Q₁ᵀ W`` with the bias ``b Q₁``. Tied embeddings are untied for the duration (the head gets the final
            norm's gain, the embedding does not). Refused (:class:`~quantcore.errors.PlanError` naming the norms) where
            a norm sits on a branch's output before the residual add (Gemma 2/3's ``post_attention_layernorm`` and
            ``post_feedforward_layernorm``): its per-channel gain does not commute with a rotation.
R2          Each attention head's values are rotated, ``v_h' = v_h Q₂`` (head_dim): v_proj's rows of head h
            ``Q₂ᵀ W_h`` (and its bias), o_proj's columns of every query head ``W[:, h] Q₂`` (under grouped-query
            attention every query head of a kv head sees the same rotation, as it is one matrix for all heads).
R4          down_proj's input is rotated online, ``x Q₄`` (intermediate width): a forward pre-hook on down_proj
            multiplies its input by Q₄ at run time (in float32 at least) and the weight is ``W Q₄``. A
            quantizer hooked on down_proj after it sees the rotated input.
V           QuIP / QuIP#'s input-side incoherence processing (llm-compressor's ``QuIPModifier``, rotations ``["v"]``):
            every decoder linear (q/k/v/o, gate/up/down; not lm_head) rotated online as R4 is, one Hadamard per
            input width (in blocks of ``block_size``). Nothing is folded, so it holds for Gemma too; alone.
==========  ==========================================================================================================

Q is a Hadamard matrix (:mod:`quantcore.algorithms.hadamard`), randomised by a seeded ±1 diagonal or block-diagonal as
the :class:`~quantcore.algorithms.rotation_spec.RotationSpec` says. Every folded weight is computed in float64 and
rounded once to its dtype into a new Parameter; :meth:`RotationHandle.restore` puts the original Parameters back
(bit for bit, ties included) and removes the hooks. MoE blocks (routed experts) are refused.

Block-streamed models (:mod:`quantcore.models.streaming`) are rotated as they stream: :func:`rotate_model` on a
:class:`~quantcore.models.streaming.StreamedModel`'s ``model`` folds the resident part (the final norm into the head,
the embedding, the head) at once and each decoder block as it loads, by the same per-block code as the whole model
(:func:`_fold_block`), its hooks removed and its folds dropped when the block is freed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quantcore.algorithms.hadamard import has_hadamard, rotation_matrix
from quantcore.algorithms.registry import register_transform
from quantcore.algorithms.rotation_spec import R1, R2, R4, RotationSpec, RotationWidths, V, block_of
from quantcore.algorithms.smoothquant import _gain_style, _weight  # the probe SmoothQuant folds norms by
from quantcore.errors import PlanError, name_list
from quantcore.models.architectures import Architecture, architecture_of

#: the rotation as a transform of the registry: set for the whole plan by its ``transforms:`` section; it reads no
#: calibrated input (the calibration of a rotated plan runs with the rotation applied)
ROTATION_TRANSFORM = register_transform("rotation", applies_to=lambda scheme: not scheme.is_identity, needs=None,
                                        plan_level=True)
POST_BRANCH_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")  # Gemma 2/3: on a branch's output
# what a block-streamed model's ``model`` carries: its StreamedModel's ``transform_blocks`` (a weak reference; the same
# name as quantcore.models.streaming.TRANSFORM_BLOCKS, not imported: that module imports the sweep, which imports this)
TRANSFORM_BLOCKS = "quantplan_transform_blocks"
NORM_PROBE_ATOL = 1e-4  # a neutral RMSNorm commutes with Q to float32 rounding; a mean-subtracting one misses by O(1)


@dataclass
class Block:
    """The modules of one decoder block a rotation touches (full names)."""

    name: str
    attn_norm: str
    mlp_norm: str
    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str
    down: str


@dataclass
class ModelLayout:
    """Where a rotation folds in one model: its blocks, embedding, final norm, head and widths."""

    arch: Architecture
    blocks: list[Block]
    embedding: str
    final_norm: str | None
    head: str | None
    widths: RotationWidths


@dataclass
class RotationHandle:
    """What :func:`rotate_model` did.

    spec: the rotation; widths: the widths it acted on; matrices: {R1/R2/R4: (n, n) float64 Q};
    folded_norms: norms whose gain went into the linears after them; online: linears with an online rotation hook.
    keep_originals: False for a streamed block's own handle: the folds are not undone, the block goes back to meta.
    """

    spec: RotationSpec
    widths: RotationWidths
    matrices: dict[str, torch.Tensor] = field(default_factory=dict)
    folded_norms: list[str] = field(default_factory=list)
    online: list[str] = field(default_factory=list)
    keep_originals: bool = True
    _saved: dict[tuple[int, str], tuple[nn.Module, str, Any]] = field(default_factory=dict, repr=False)
    _hooks: list[Any] = field(default_factory=list, repr=False)
    _config: tuple[Any, Any] | None = field(default=None, repr=False)

    def _set(self, module: nn.Module, attr: str, value: torch.Tensor) -> None:
        """Replace ``module.<attr>`` by a new Parameter holding ``value`` (its dtype and device kept); the original
        Parameter is kept once for :meth:`restore`."""
        old = getattr(module, attr)
        if self.keep_originals:
            self._saved.setdefault((id(module), attr), (module, attr, old))
        setattr(module, attr, nn.Parameter(value.to(device=old.device, dtype=old.dtype), requires_grad=False))

    @torch.no_grad()
    def restore(self) -> None:
        """Remove the hooks and put every original Parameter back (a tied embedding is tied again); idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module, attr, original in reversed(list(self._saved.values())):
            setattr(module, attr, original)
        self._saved.clear()
        if self._config is not None:
            config, tied = self._config
            config.tie_word_embeddings = tied
            self._config = None


# ---------------------------------------------------------------------------- the model's layout


def _head_dim(attn: nn.Module, model: nn.Module, v: nn.Linear) -> int:
    head_dim = getattr(attn, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and v.out_features % head_dim == 0:
        return head_dim
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if isinstance(heads, int) and isinstance(hidden, int) and heads and hidden % heads == 0:
        return hidden // heads
    raise PlanError(f"{type(attn).__name__} has no head_dim and its config no num_attention_heads: R2 needs the "
                    "width of one attention head")


def model_layout(model: nn.Module) -> ModelLayout:
    """The blocks, embedding, final norm and head of a decoder ``model``, and the widths a rotation acts on;
    PlanError for a model whose blocks are not Llama-style (no attention norm, routed experts)."""
    modules = dict(model.named_modules())
    arch = architecture_of(model)
    suffix = f".{arch.attention_norm}"
    names = [n[: -len(suffix)] for n in modules if n.endswith(suffix)]
    if not names:
        raise PlanError(f"{type(model).__name__} has no decoder blocks with an {arch.attention_norm}: rotations fold "
                        "into Llama-style decoders only")
    blocks, problems = [], []
    for b in names:
        attn, mlp = f"{b}.{arch.attention}", f"{b}.{arch.mlp}"
        if arch.experts_of(b) in modules:
            problems.append(f"{b}: routed experts (MoE) are not rotated here")
            continue
        block = Block(b, arch.attention_norm_of(b), arch.mlp_norm_of(b, modules), *(f"{attn}.{x}" for x in (
            arch.q_proj, arch.k_proj, arch.v_proj, arch.o_proj)), *(f"{mlp}.{x}" for x in (
                arch.gate_proj, arch.up_proj, arch.down_proj)))
        missing = [n for n in (block.q, block.k, block.v, block.o, block.gate, block.up, block.down)
                   if not isinstance(modules.get(n), nn.Linear)] + [
            n for n in (block.attn_norm, block.mlp_norm) if n not in modules]
        if missing:
            problems.append(f"{b}: no {name_list(missing, 3)}")
            continue
        blocks.append(block)
    if problems:
        raise PlanError("This model cannot be rotated: " + "; ".join(problems[:3])
                        + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
    by_id = {id(m): n for n, m in modules.items()}
    get_emb, get_head = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    head = get_head() if callable(get_head) else None
    if emb is None or id(emb) not in by_id:
        raise PlanError(f"{type(model).__name__} has no input embedding module: R1 rotates it")
    prefix = names[0].rsplit(".", 2)[0] if names[0].count(".") >= 2 else ""
    final_norm = f"{prefix}.norm" if f"{prefix}.norm" in modules else None
    first, down = _linear(modules, blocks[0].v), _linear(modules, blocks[0].down)
    attn_module = modules[blocks[0].v.rsplit(".", 1)[0]]
    widths = RotationWidths(
        hidden=first.in_features, head_dim=_head_dim(attn_module, model, first), intermediate=down.in_features,
        layers={
            R1: (by_id[id(emb)], *(n for b in blocks for n in (b.q, b.k, b.v, b.o, b.gate, b.up, b.down)),
                 *((by_id[id(head)],) if head is not None and id(head) in by_id else ())),
            R2: tuple(n for b in blocks for n in (b.v, b.o)),
            R4: tuple(b.down for b in blocks),
            V: tuple(n for b in blocks for n in (b.q, b.k, b.v, b.o, b.gate, b.up, b.down)),
        },
        in_features={n: _linear(modules, n).in_features
                     for b in blocks for n in (b.q, b.k, b.v, b.o, b.gate, b.up, b.down)})
    return ModelLayout(arch, blocks, by_id[id(emb)], final_norm,
                       by_id[id(head)] if head is not None and id(head) in by_id else None, widths)


def check_rotation(spec: RotationSpec, widths: RotationWidths) -> None:
    """PlanError naming the layers whose width the rotation's Hadamard cannot cover (no matrix of that order is
    built, or the block size does not divide it)."""
    problems: list[str] = []
    if V in spec.rotations:  # each linear at its own input width
        for width, layers in widths.v_widths().items():
            _check_width(problems, f"V on {len(layers)} layer(s) ({name_list(list(layers), 3)}), width {width}",
                         width, block_of(spec, V, width))
    for r in spec.rotations:
        if r == V:
            continue
        width = widths.of(r)
        block = block_of(spec, r, width)
        layers = widths.layers.get(r, ())
        where = f"{r} on {len(layers)} layer(s) ({name_list(list(layers), 3)}), width {width}"
        if width % block:
            problems.append(f"{where}: the block size {block} does not divide {width}")
        elif not has_hadamard(block):
            problems.append(f"{where}: no Hadamard matrix of order {block} is built (orders: powers of two times "
                            "products of 12, 20, 28, 36, 44); set transforms.rotation.block_size to a power of two "
                            f"that divides {width}")
    if problems:
        raise PlanError("This rotation cannot be applied to this model: " + "; ".join(problems))


# ---------------------------------------------------------------------------- folding


def _check_width(problems: list[str], where: str, width: int, block: int) -> None:
    if width % block:
        problems.append(f"{where}: the block size {block} does not divide {width}")
    elif not has_hadamard(block):
        problems.append(f"{where}: no Hadamard matrix of order {block} is built (orders: powers of two times products "
                        f"of 12, 20, 28, 36, 44); set transforms.rotation.block_size to a power of two that divides "
                        f"{width}")


def _linear(modules: Mapping[str, nn.Module], name: str) -> nn.Linear:
    module = modules[name]
    assert isinstance(module, nn.Linear)
    return module


def _fold_norm(handle: RotationHandle, norm: nn.Module, name: str, consumers: list[nn.Linear]) -> None:
    """Fold the norm's gain into its consumers' input columns and set it neutral."""
    style = _gain_style(norm)
    if style not in ("mul", "one_plus"):
        raise PlanError(f"{name} ({type(norm).__name__}) is not an RMSNorm with a per-channel gain: a rotation "
                        "commutes only with a norm that rescales the whole vector")
    w = _weight(norm).detach().double()
    gain = 1.0 + w if style == "one_plus" else w
    for linear in consumers:
        handle._set(linear, "weight", linear.weight.detach().double() * gain.to(linear.weight.device))
    handle._set(norm, "weight", torch.zeros_like(w) if style == "one_plus" else torch.ones_like(w))
    handle.folded_norms.append(name)


def _probe_norm(norm: nn.Module, name: str, q: torch.Tensor) -> None:
    """PlanError unless the (neutral) norm commutes with ``q``: n(x Q) = n(x) Q on a random input."""
    weight = getattr(norm, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
    x = torch.randn(4, q.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    qd = q.to(device=device, dtype=torch.float32)
    with torch.no_grad():
        a = norm(x.to(device, torch.float32).to(dtype)).float() @ qd
        b = norm((x.to(device, torch.float32) @ qd).to(dtype)).float()
    if not torch.allclose(a, b, atol=NORM_PROBE_ATOL * max(1.0, float(a.abs().max())), rtol=1e-2):
        raise PlanError(f"{name} ({type(norm).__name__}) does not commute with a rotation (it is not a plain RMSNorm "
                        "once its gain is folded): R1 cannot be applied exactly")


def _refuse_post_branch_norms(layout: ModelLayout, modules: Mapping[str, nn.Module]) -> None:
    post = [f"{b.name}.{n}" for b in layout.blocks for n in POST_BRANCH_NORMS
            if f"{b.name}.{n}" in modules and f"{b.name}.{n}" not in (b.attn_norm, b.mlp_norm)]
    if post:
        raise PlanError(f"R1 cannot be applied exactly to this {layout.arch.name} model: {name_list(post, 3)} "
                        "normalise a branch's output before the residual add, and their per-channel gain does not "
                        "commute with a rotation of the residual stream (QuaRot and SpinQuant rotate Llama-style "
                        "blocks only); drop R1 (R2 and R4 apply)")


def _linears_of(b: Block) -> tuple[str, ...]:
    return (b.q, b.k, b.v, b.o, b.gate, b.up, b.down)


def _block_online(spec: RotationSpec, b: Block) -> list[str]:
    """The linears of ``b`` whose input ``spec`` rotates online: every one under V, down_proj under R4."""
    return list(_linears_of(b)) if V in spec.rotations else [b.down] if R4 in spec.rotations else []


def _block_norms(spec: RotationSpec, b: Block) -> list[str]:
    return [b.attn_norm, b.mlp_norm] if R1 in spec.rotations else []


def _rotate_rows(handle: RotationHandle, lin: nn.Linear, q: torch.Tensor) -> None:
    """An output projection of the residual stream under R1: ``Q₁ᵀ W``, its bias ``b Q₁``."""
    qd = q.to(lin.weight.device)
    handle._set(lin, "weight", qd.T @ lin.weight.detach().double())
    if lin.bias is not None:
        handle._set(lin, "bias", lin.bias.detach().double() @ qd)


def _fold_block(handle: RotationHandle, modules: Mapping[str, nn.Module], b: Block) -> None:
    """Every fold of ``handle.spec`` inside decoder block ``b``, in the order each tensor goes through them (V; R1's
    norm folds, then its input and output rotations; R2 on v/o; R4's online down_proj): the whole model's
    :func:`rotate_model` and a streamed block as it loads (:func:`_block_rotated`) run this one code."""
    spec, matrices = handle.spec, handle.matrices
    if V in spec.rotations:  # QuIP's input-side incoherence: every linear's input online, one matrix per width
        for name in _block_online(spec, b):
            _online(handle, modules, name, matrices[f"{V}{handle.widths.in_features[name]}"])
    if R1 in spec.rotations:
        q = matrices[R1]
        _fold_norm(handle, modules[b.attn_norm], b.attn_norm, [_linear(modules, n) for n in (b.q, b.k, b.v)])
        _fold_norm(handle, modules[b.mlp_norm], b.mlp_norm, [_linear(modules, n) for n in (b.gate, b.up)])
        for name in _block_norms(spec, b):
            _probe_norm(modules[name], name, q)
        for n in (b.q, b.k, b.v, b.gate, b.up):
            lin = _linear(modules, n)
            handle._set(lin, "weight", lin.weight.detach().double() @ q.to(lin.weight.device))
        for n in (b.o, b.down):
            _rotate_rows(handle, _linear(modules, n), q)
    if R2 in spec.rotations:
        _r2(handle, modules, b, matrices[R2])
    if R4 in spec.rotations:
        _online(handle, modules, b.down, matrices[R4])


def _fold_resident(handle: RotationHandle, model: nn.Module, layout: ModelLayout,
                   modules: Mapping[str, nn.Module]) -> None:
    """R1's folds outside the decoder blocks: the final norm's gain into the head, the embedding ``E Q₁`` and the head
    ``W Q₁`` (a tied embedding untied while rotated). Nothing for R2, R4 and V."""
    if R1 not in handle.spec.rotations:
        return
    q = handle.matrices[R1]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "tie_word_embeddings"):
        handle._config = (config, config.tie_word_embeddings)
        config.tie_word_embeddings = False  # untied while rotated: the head gets the final norm's gain
    head = _linear(modules, layout.head) if layout.head is not None else None
    if layout.final_norm is not None and head is not None:
        _fold_norm(handle, modules[layout.final_norm], layout.final_norm, [head])
        _probe_norm(modules[layout.final_norm], layout.final_norm, q)
    emb = modules[layout.embedding]
    ew = _weight(emb)
    handle._set(emb, "weight", ew.detach().double() @ q.to(ew.device))
    if head is not None:
        handle._set(head, "weight", head.weight.detach().double() @ q.to(head.weight.device))


def _r2(handle: RotationHandle, modules: Mapping[str, nn.Module], b: Block, q: torch.Tensor) -> None:
    hd = q.shape[0]
    v, o = _linear(modules, b.v), _linear(modules, b.o)
    qd = q.to(v.weight.device)
    w = v.weight.detach().double().view(-1, hd, v.in_features)  # (kv heads, hd, in)
    handle._set(v, "weight", torch.einsum("ji,hjk->hik", qd, w).reshape(v.out_features, v.in_features))
    if v.bias is not None:
        handle._set(v, "bias", (v.bias.detach().double().view(-1, hd) @ qd).flatten())
    wo = o.weight.detach().double().view(o.out_features, -1, hd)  # (out, query heads, hd)
    handle._set(o, "weight", (wo @ q.to(o.weight.device)).reshape(o.out_features, o.in_features))


# the attribute an online-rotated linear carries while rotated: its input's rotation, x -> x Q₄. A forward pre-hook
# registered later with prepend=True runs before R4's and sees the unrotated input: it applies this to see what the
# layer computes with (quantcore.evaluation.sensitivity's local SQNR)
ONLINE_ROTATION = "quantplan_online_rotation"


def _online_hook(q: torch.Tensor):
    cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def rotate(x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        key = (x.device, dtype)
        if key not in cache:
            cache[key] = q.to(device=x.device, dtype=dtype)
        return (x.to(dtype) @ cache[key]).to(x.dtype)

    def hook(module: nn.Module, args: tuple) -> tuple:
        return (rotate(args[0]), *args[1:])

    return hook, rotate


class _Attribute:
    """``module.<name> = value`` until :meth:`remove` (kept with a rotation's hooks, removed with them)."""

    def __init__(self, module: nn.Module, name: str, value: Any) -> None:
        self.module, self.name = module, name
        object.__setattr__(module, name, value)

    def remove(self) -> None:
        if self.name in self.module.__dict__:
            object.__delattr__(self.module, self.name)


def _online(handle: RotationHandle, modules: Mapping[str, nn.Module], name: str, q: torch.Tensor) -> None:
    """``name``'s input rotated online by ``q`` (a pre-hook), its weight's columns by the same ``q`` (W Q): the same
    function, x W^T = (x Q)(W Q)^T."""
    lin = _linear(modules, name)
    handle._set(lin, "weight", lin.weight.detach().double() @ q.to(lin.weight.device))
    hook, rotate = _online_hook(q)
    handle._hooks.append(lin.register_forward_pre_hook(hook, prepend=True))
    handle._hooks.append(_Attribute(lin, ONLINE_ROTATION, rotate))  # removed with the hooks
    handle.online.append(name)


def _matrices(spec: RotationSpec, widths: RotationWidths) -> dict[str, torch.Tensor]:
    """{R1 / R2 / R4: Q, and ``V<width>`` for V's one matrix per input width}, float64."""
    out: dict[str, torch.Tensor] = {}
    for r in spec.rotations:
        if r == V:
            for width in widths.v_widths():
                out[f"{V}{width}"] = rotation_matrix(width, block_size=block_of(spec, V, width), seed=spec.seed_for(V))
        else:
            width = widths.of(r)
            out[r] = rotation_matrix(width, block_size=block_of(spec, r, width), seed=spec.seed_for(r))
    return out


@contextmanager
def _block_rotated(handle: RotationHandle, modules: Mapping[str, nn.Module], block: Block) -> Iterator[None]:
    """A streamed block rotated as it loads (:func:`_fold_block`), its online hooks removed when it is freed; its
    original weights are not kept (the block goes back to ``meta``, and is read again from the checkpoint)."""
    own = RotationHandle(handle.spec, handle.widths, handle.matrices, keep_originals=False)
    try:
        _fold_block(own, modules, block)
        yield
    finally:
        own.restore()


@torch.no_grad()
def rotate_model(model: nn.Module, spec: RotationSpec) -> RotationHandle:
    """Fold ``spec``'s rotations into ``model`` in place (R4 as an online hook); ``restore()`` undoes it bit for bit.

    A block-streamed model (:class:`~quantcore.models.streaming.StreamedModel`'s ``model``) is rotated as it streams:
    the embedding, final norm and head now, each decoder block as it loads (the same folds, the same arithmetic:
    bit-identical to the whole model's) until ``restore()``; rotate it before its blocks run.

    PlanError (nothing changed) for a width no Hadamard of the plan covers, naming the layers, or a model the
    rotation cannot fold into exactly (see the module docstring)."""
    layout = model_layout(model)
    check_rotation(spec, layout.widths)
    modules = dict(model.named_modules())
    handle = RotationHandle(spec, layout.widths, _matrices(spec, layout.widths))
    ref = model.__dict__.get(TRANSFORM_BLOCKS)
    transform_blocks = ref() if ref is not None else None
    try:
        if R1 in spec.rotations:
            _refuse_post_branch_norms(layout, modules)
        if transform_blocks is None:
            for b in layout.blocks:
                _fold_block(handle, modules, b)
        else:  # each block as it loads (block i: the i-th decoder block); listed now (AWQ skips the online layers)
            blocks = layout.blocks
            handle._hooks.append(transform_blocks(lambda i: _block_rotated(handle, modules, blocks[i])))
            for b in layout.blocks:
                handle.online.extend(_block_online(spec, b))
                handle.folded_norms.extend(_block_norms(spec, b))
        _fold_resident(handle, model, layout, modules)
    except BaseException:
        handle.restore()
        raise
    return handle


@contextmanager
def rotation_applied(model: nn.Module, spec: RotationSpec | None) -> Iterator[RotationHandle | None]:
    """``model`` rotated as ``spec`` says for the block (None: unchanged), restored on exit."""
    if spec is None:
        yield None
        return
    handle = rotate_model(model, spec)
    try:
        yield handle
    finally:
        handle.restore()


def smoothing_kept(spec: RotationSpec, online: Iterable[str], alphas: Mapping[str, float]
                   ) -> tuple[dict[str, float], list[str]]:
    """(the SmoothQuant alphas still exact under ``spec``, notes for people): a layer whose input ``spec`` rotates
    online (``online``) is left unsmoothed, since its factors would fold into the rows before the Hadamard."""
    online = set(online)
    dropped = [n for n in alphas if n in online]
    how = "V rotates every decoder linear's input" if V in spec.rotations else "R4 rotates their input"
    notes = [f"{len(dropped)} layer(s) ({name_list(dropped, 3)}): SmoothQuant not applied ({how} online, after the "
             "rows where the factors would fold); they are quantized rotated"] if dropped else []
    return {n: a for n, a in alphas.items() if n not in online}, notes


def online_layers(model: nn.Module, spec: RotationSpec) -> list[str]:
    """The linears whose input ``spec`` rotates online in ``model`` (R4: every down_proj; V: every decoder linear),
    without rotating anything."""
    return [n for b in model_layout(model).blocks for n in _block_online(spec, b)]


def rotate_for_plan(model: nn.Module, spec: RotationSpec, alphas: Mapping[str, float]
                    ) -> tuple[RotationHandle, dict[str, float], list[str]]:
    """Rotate ``model`` for a plan whose SmoothQuant alphas are ``alphas``: (handle, the alphas still exact after
    the rotation, notes for people). SmoothQuant folds down_proj's factors into up_proj's rows, before R4's online
    Hadamard, so a down_proj under R4 (every linear under V) is left unsmoothed (the rotation already spreads its
    outliers): :func:`smoothing_kept`."""
    handle = rotate_model(model, spec)
    kept, notes = smoothing_kept(spec, handle.online, alphas)
    return handle, kept, notes


@contextmanager
def rotated_for_sweep(model: nn.Module, inputs: Any, layers: Iterable[str], schemes: Iterable[Any]
                      ) -> Iterator[Any]:
    """``model`` rotated once by ``inputs.rotation`` for a whole sensitivity sweep or Fisher estimate (every unit is
    then quantized in the rotated model, as a rotated plan is scored), restored on exit; yields ``inputs`` without
    the rotation (the units must not rotate again). A streamed model is rotated as it streams (:func:`rotate_model`).
    The inputs' statistics, Hessians and AWQ factors must be those of the rotated model. PlanError, nothing rotated,
    where a SmoothQuant scheme would smooth a layer whose input is rotated online (R4's down_proj, every linear under
    V: the factors would fold into the rows before the Hadamard; a score leaves such a layer unsmoothed:
    :func:`rotate_for_plan`), naming the layers."""
    spec = inputs.rotation
    handle = rotate_model(model, spec)
    try:
        online = set(handle.online)
        smoothed = [n for n in layers if n in online] if any(
            getattr(s, "smoothquant_alpha", None) is not None for s in schemes) else []
        if smoothed:
            raise PlanError(f"{len(smoothed)} layer(s) ({name_list(smoothed, 3)}) cannot be swept with "
                            f"SmoothQuant under {spec.label()}: their input is rotated online (R4, V), after the "
                            "rows the factors would fold into; leave them out of the sweep, or sweep without that "
                            "rotation")
        yield inputs.replace(rotation=None)
    finally:
        handle.restore()


def rotation_widths(model: nn.Module) -> RotationWidths:
    """The widths R1, R2 and R4 act on in ``model`` and the layers each touches."""
    return model_layout(model).widths


__all__ = ["ONLINE_ROTATION", "ROTATION_TRANSFORM", "RotationHandle", "check_rotation", "model_layout",
           "online_layers", "rotate_for_plan", "rotate_model", "rotated_for_sweep", "rotation_applied",
           "rotation_widths", "smoothing_kept"]
