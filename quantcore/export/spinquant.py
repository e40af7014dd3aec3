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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quantcore.algorithms.rotation_spec import R1, R2, R4, RotationSpec, RotationWidths, block_of
from quantcore.errors import PlanError, name_list
from quantcore.errors import format_problems as _format
from quantcore.models.architectures import LLAMA_STYLE

SPINQUANT_MODIFIER = "SpinQuantModifier"
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
                                  R4: tuple(down)})


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
    return {RECIPE_ROTATION_GROUP: {SPINQUANT_MODIFIER: spinquant_modifier(spec, widths)}}


ROTATION_HEADER = ("# SpinQuantModifier rotates first ({rotations}, Hadamard{block}); it centres the embedding rows "
                   "before rotating, which quantplan's exact rotation does not (see docs/results/rotations.md)\n")


__all__ = ["RECIPE_ROTATION_GROUP", "ROTATION_HEADER", "SPINQUANT_MODIFIER", "rotation_stage", "spinquant_modifier",
           "widths_from_linears"]
