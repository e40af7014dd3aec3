"""A plan's Hadamard rotation as llm-compressor's ``SpinQuantModifier`` (torch-free).

llm-compressor 0.14's ``SpinQuantModifier`` (``llmcompressor/modifiers/transform/spinquant``) folds the RMSNorm gains
into the linears after them, rotates R1 (embedding, q/k/v/o, gate/up/down, lm_head) and R2 (v_proj rows, o_proj
columns, one head_dim Hadamard) into the weights and adds R4 as an online transform of down_proj's input: what
:mod:`quantcore.algorithms.rotation` does. What it can express, and so what is exported:

- ``transform_type: hadamard`` builds Sylvester matrices only (compressed-tensors' ``deterministic_hadamard_matrix``:
  powers of two), the same matrices quantplan builds for those orders; ``transform_block_size`` is the plan's
  ``block_size`` (R1 and R4; R2 takes head_dim). A rotation over a width that is not a power of two (SmolLM2's 576
  without a block size) is refused, naming the layers and the block size that would do.
- ``random-hadamard`` draws its ±1 signs from compressed-tensors' own generator, never from a seed given in the
  recipe: quantplan's seeded randomised Hadamard cannot be carried, and is refused (the model llm-compressor made
  would not be the model quantplan scored).
- Before rotating, ``SpinQuantModifier`` centres the embedding rows (subtracts each row's mean), which a LayerNorm
  model tolerates and an RMSNorm model does not exactly: the exported model differs from the scored one by that
  shift (measured in docs/results/rotations.md).

A plan rotating ``[V]`` (QuIP's input-side incoherence rotation of every decoder linear) is written as
``QuIPModifier`` (``llmcompressor/modifiers/transform/quip``) with ``rotations: [v]``, ``transform_type: hadamard``,
``transform_block_size`` the plan's block size, ``ignore: lm_head``: an online Hadamard on every other Linear's
input and its inverse fused into the weight, what :mod:`quantcore.algorithms.rotation` does for V. Refused, naming
the layers: a width no power-of-two block covers, a seeded random-hadamard (as above), and a Linear outside the
decoder blocks other than lm_head (QuIPModifier targets every Linear; quantplan's V rotates the blocks' only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quantcore.algorithms.rotation_spec import R1, R2, R4, RotationSpec, RotationWidths, V, block_of
from quantcore.errors import PlanError, name_list
from quantcore.errors import format_problems as _format
from quantcore.models.architectures import LLAMA_STYLE

SPINQUANT_MODIFIER = "SpinQuantModifier"
QUIP_MODIFIER = "QuIPModifier"
RECIPE_ROTATION_GROUP = "rotation_modifiers"  # the first group of the stage: rotate, then smooth and round


def widths_from_linears(linears: Sequence[Mapping[str, Any]], head_dim: int | None) -> RotationWidths:
    """The widths and layers of R1, R2 and R4 from an intake summary's ``[{name, in_features, ...}]`` (torch-free)."""
    a = LLAMA_STYLE
    by = {str(lin["name"]): int(lin["in_features"]) for lin in linears}
    q = [n for n in by if a.attention_input_block(n) and n.endswith(f".{a.q_proj}")]
    down = [n for n in by if n.endswith(f".{a.mlp}.{a.down_proj}")]
    blocks = [n for n in by if a.attention_input_block(n) or a.mlp_input_block(n) or a.attention_output_block(n)
              or a.mlp_output(n)]
    r1 = tuple(blocks + [n for n in by if n == "lm_head"])
    return RotationWidths(hidden=by[q[0]] if q else 0, head_dim=int(head_dim or 0),
                          intermediate=by[down[0]] if down else 0,
                          layers={R1: r1, R2: tuple(n for n in blocks if n.endswith((f".{a.v_proj}", f".{a.o_proj}"))),
                                  R4: tuple(down), V: tuple(blocks),
                                  # what QuIPModifier would rotate beyond the blocks (it targets every Linear)
                                  "other": tuple(n for n in by if n not in blocks and n != "lm_head")},
                          in_features={n: by[n] for n in blocks})


def quip_modifier(spec: RotationSpec, widths: RotationWidths) -> dict[str, Any]:
    """``QuIPModifier``'s arguments for a plan rotating ``[V]``; PlanError naming the layers llm-compressor cannot
    rotate as quantplan does (see the module docstring)."""
    problems = []
    if spec.randomized:
        problems.append(f"random-hadamard with seed {spec.seed}: QuIPModifier draws its random signs from its own "
                        "generator, not from a seed in the recipe; use kind: hadamard to export")
    for width, layers in widths.v_widths().items():
        block = block_of(spec, V, width)
        if block & (block - 1) or width % block:
            problems.append(f"V on {len(layers)} layer(s) ({name_list(list(layers), 3)}): a Hadamard of order {block} "
                            f"over width {width}, but QuIPModifier's hadamard transform builds powers of two only; "
                            f"set transforms.rotation.block_size to a power of two dividing every width (e.g. "
                            f"{min(w & -w for w in widths.v_widths())})")
    if other := list(widths.layers.get("other", ())):
        problems.append(f"{len(other)} Linear layer(s) outside the decoder blocks ({name_list(other, 3)}): "
                        "QuIPModifier would rotate them too, quantplan's V does not")
    if not widths.layers.get(V):
        problems.append("the model's summary names no decoder linear for V to rotate")
    if problems:
        raise PlanError(_format("This plan's rotation cannot be written for llm-compressor", problems))
    args: dict[str, Any] = {"rotations": ["v"], "transform_type": "hadamard", "ignore": "lm_head"}
    if spec.block_size is not None:
        args["transform_block_size"] = spec.block_size
    return args


def spinquant_modifier(spec: RotationSpec, widths: RotationWidths) -> dict[str, Any]:
    """``SpinQuantModifier``'s arguments for ``spec``; PlanError naming the layers llm-compressor cannot rotate as
    quantplan does (see the module docstring)."""
    problems = []
    if spec.randomized:
        problems.append(f"random-hadamard with seed {spec.seed}: SpinQuantModifier draws its random signs from its own "
                        "generator, not from a seed in the recipe, so it would rotate "
                        f"{name_list(list(widths.layers.get(spec.rotations[0], ())), 3)} differently from the plan "
                        "scored; use kind: hadamard to export")
    for r in spec.rotations:
        width = widths.of(r)
        block = block_of(spec, r, width)
        if width <= 0:
            problems.append(f"{r}: the model's summary gives no width for it")
        elif block & (block - 1):
            layers = list(widths.layers.get(r, ()))
            fix = ("" if r == R2 else
                   f"; set transforms.rotation.block_size to a power of two that divides {width} (e.g. "
                   f"{width & -width})")
            problems.append(f"{r} on {len(layers)} layer(s) ({name_list(layers, 3)}): a Hadamard of order {block}, "
                            "but SpinQuantModifier's hadamard transform builds powers of two only" + fix)
    if problems:
        raise PlanError(_format("This plan's rotation cannot be written for llm-compressor", problems))
    args: dict[str, Any] = {"rotations": [r for r in (R1, R2, R4) if r in spec.rotations], "transform_type": "hadamard"}
    if spec.block_size is not None:
        args["transform_block_size"] = spec.block_size
    return args


def rotation_stage(spec: RotationSpec | None, widths: RotationWidths | None) -> dict[str, Any]:
    """The recipe stage's rotation group (``{rotation_modifiers: {SpinQuantModifier: ...}}``), empty without one."""
    if spec is None:
        return {}
    if widths is None:
        raise PlanError("exporting a rotation needs the model's widths (hidden, head_dim, intermediate)")
    if V in spec.rotations:
        return {RECIPE_ROTATION_GROUP: {QUIP_MODIFIER: quip_modifier(spec, widths)}}
    return {RECIPE_ROTATION_GROUP: {SPINQUANT_MODIFIER: spinquant_modifier(spec, widths)}}


ROTATION_HEADER = ("# SpinQuantModifier rotates first ({rotations}, Hadamard{block}); it centres the embedding rows "
                   "before rotating, which quantplan's exact rotation does not (see docs/results/rotations.md)\n")
QUIP_HEADER = ("# QuIPModifier rotates first (every decoder Linear's input, online, Hadamard{block}), as quantplan's V "
               "rotation does\n")


def rotation_header(spec: RotationSpec) -> str:
    """The recipe's comment line for ``spec``'s modifier."""
    block = f" blocks of {spec.block_size}" if spec.block_size else ""
    if V in spec.rotations:
        return QUIP_HEADER.format(block=block)
    return ROTATION_HEADER.format(rotations=" + ".join(spec.rotations), block=block)


__all__ = ["QUIP_MODIFIER", "RECIPE_ROTATION_GROUP", "ROTATION_HEADER", "SPINQUANT_MODIFIER", "quip_modifier",
           "rotation_header", "rotation_stage", "spinquant_modifier", "widths_from_linears"]
