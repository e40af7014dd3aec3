"""A plan's rotation as data: which Hadamard rotations (R1, R2, R4), plain or randomised, whole or in blocks.

Torch-free: the plan file, the plan editor and the llm-compressor export read it without torch. The rotation itself
is :mod:`quantcore.algorithms.rotation`; the matrices are :mod:`quantcore.algorithms.hadamard`.

In a plan file (``transforms:``; SmoothQuant's α stays in ``smoothquant_alpha``)::

    transforms:
      rotation:
        kind: hadamard            # or random-hadamard (a random ±1 diagonal drawn from ``seed``)
        rotations: [R1, R2, R4]   # any of them; SpinQuant's names (R3, inside attention, is not built); or [V]
                                  #   alone: QuIP's input rotation of every decoder linear (QuIPModifier)
        block_size: 64            # optional: a block-diagonal Hadamard of this order for R1 and R4 (MR-GPTQ);
                                  #   without it, one Hadamard of the whole width (576 = 36 x 16 is built)
        seed: 0                   # random-hadamard only (default 0)

R1 rotates the residual stream (the embedding, every block's input and output projections, the head; the RMSNorm
gains folded into the linears after them first, as QuaRot does), R2 each attention head's values (v_proj's rows,
o_proj's columns; always one Hadamard of the head dimension), R4 the input of every down_proj (online: a Hadamard
applied to the input at run time, its transpose folded into the weight). All three leave the full-precision model's
function unchanged; quantization then sees the rotated weights and activations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from quantcore.errors import PlanError
from quantcore.errors import format_problems as _format

HADAMARD = "hadamard"
RANDOM_HADAMARD = "random-hadamard"
ROTATION_KINDS = (HADAMARD, RANDOM_HADAMARD)
R1, R2, R4 = "R1", "R2", "R4"
ROTATIONS = (R1, R2, R4)  # SpinQuant's names; R3 (query / key inside attention) is not built
# QuIP / QuIP#'s incoherence processing, input side (llm-compressor's QuIPModifier rotations: ["v"]): every decoder
# linear's input rotated online, its weight's columns by the transpose; alone (it rotates what R1 / R2 / R4 do)
V = "V"
ALL_ROTATIONS = (*ROTATIONS, V)
MAX_BLOCK = 1 << 16  # widest Hadamard block (quantcore.algorithms.hadamard.MAX_ORDER)
MAX_SEED = (1 << 63) - 1  # a torch.Generator seed is a 64-bit integer
_KEYS = ("kind", "rotations", "block_size", "seed")
TRANSFORM_KEYS = ("rotation",)  # the keys of a plan's ``transforms:`` section


@dataclass(frozen=True)
class RotationSpec:
    """A plan's rotation (see the module docstring).

    kind: ``hadamard`` or ``random-hadamard``; rotations: a non-empty subset of R1, R2, R4 in that order;
    block_size: the order of each diagonal block of R1 and R4 (None: the whole width); seed: the ±1 diagonal's seed
    (random-hadamard only).
    """

    kind: str = HADAMARD
    rotations: tuple[str, ...] = ROTATIONS
    block_size: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = _problems(self.kind, self.rotations, self.block_size, self.seed)
        if problems:
            raise PlanError(_format("This rotation is malformed", problems))

    @property
    def randomized(self) -> bool:
        return self.kind == RANDOM_HADAMARD

    def seed_for(self, rotation: str) -> int | None:
        """The seed of one rotation's ±1 diagonal: the stored seed plus its index, so R1, R2 and R4 differ; None for
        a plain Hadamard."""
        return None if not self.randomized else int(self.seed or 0) + ALL_ROTATIONS.index(rotation)

    def label(self) -> str:
        """Short text for tables: ``hadamard R1+R2+R4 /64`` (``, seed 3`` when randomised)."""
        text = f"{self.kind} {'+'.join(self.rotations)}"
        if self.block_size is not None:
            text += f" /{self.block_size}"
        if self.randomized:
            text += f", seed {self.seed or 0}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """The plan file's ``rotation:`` entry; :func:`rotation_from_dict` inverts it."""
        out: dict[str, Any] = {"kind": self.kind, "rotations": list(self.rotations)}
        if self.block_size is not None:
            out["block_size"] = self.block_size
        if self.randomized:
            out["seed"] = int(self.seed or 0)
        return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _problems(kind: Any, rotations: Any, block_size: Any, seed: Any) -> list[str]:
    problems = []
    if kind not in ROTATION_KINDS:
        problems.append(f"'kind' must be one of {', '.join(ROTATION_KINDS)}, got {kind!r}")
    if not isinstance(rotations, tuple) or not rotations or any(r not in ALL_ROTATIONS for r in rotations):
        problems.append(f"'rotations' must be a non-empty list of {', '.join(ROTATIONS)} (R3, inside attention, is "
                        f"not built), or [V] alone (QuIP's input rotation of every linear), got "
                        f"{list(rotations) if isinstance(rotations, tuple) else rotations!r}")
    elif len(set(rotations)) != len(rotations):
        problems.append(f"'rotations' names one rotation twice: {list(rotations)}")
    elif V in rotations and len(rotations) > 1:
        problems.append(f"'rotations': V (QuIP's input rotation of every linear) goes alone, it already rotates the "
                        f"inputs R1, R2 and R4 would; got {list(rotations)}")
    if block_size is not None and (not _is_int(block_size) or not 1 < block_size <= MAX_BLOCK):
        problems.append(f"'block_size' must be an integer from 2 to {MAX_BLOCK} (the order of each Hadamard block, "
                        f"e.g. 64), got {block_size!r}")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
            problems.append(f"'seed' must be an integer from 0 to {MAX_SEED}, got {seed!r}")
        elif kind == HADAMARD:
            problems.append("'seed' is for kind random-hadamard; a plain hadamard has no random part (drop the seed "
                            "or set kind: random-hadamard)")
    return problems


def rotation_from_dict(data: Any, where: str = "'transforms.rotation'") -> RotationSpec:
    """Parse a plan file's ``rotation:`` entry; PlanError listing every problem."""
    if not isinstance(data, Mapping):
        raise PlanError(f"{where} must be a mapping with keys {', '.join(_KEYS)}, got {data!r}")
    unknown = [k for k in data if k not in _KEYS]
    problems = [f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(_KEYS)}"] if unknown else []
    kind = data.get("kind", HADAMARD)
    raw = data.get("rotations", list(ROTATIONS))
    if isinstance(raw, str):
        raw = [raw]
    rotations = raw
    if isinstance(raw, (list, tuple)):  # upper case, in R1, R2, R4 order (duplicates kept for the check)
        upper = (r.upper() if isinstance(r, str) else r for r in raw)
        rotations = tuple(sorted(upper, key=lambda r: ALL_ROTATIONS.index(r) if r in ALL_ROTATIONS
                                 else len(ALL_ROTATIONS)))
    seed = data.get("seed")
    if seed is None and kind == RANDOM_HADAMARD:
        seed = 0
    problems += _problems(kind, rotations, data.get("block_size"), seed)
    if problems:
        raise PlanError(_format(f"{where} is malformed", problems))
    return RotationSpec(kind, rotations, data.get("block_size"), seed)


def transforms_from_dict(data: Any) -> RotationSpec | None:
    """Parse a plan file's ``transforms:`` section (None or empty: no transform)."""
    if data is None or (isinstance(data, Mapping) and not data):
        return None
    if not isinstance(data, Mapping):
        raise PlanError(f"'transforms' must be a mapping such as {{rotation: {{kind: hadamard}}}}, got {data!r}")
    unknown = [k for k in data if k not in TRANSFORM_KEYS]
    if unknown:
        raise PlanError(f"'transforms': unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                        f"{', '.join(TRANSFORM_KEYS)} (SmoothQuant's alpha is 'smoothquant_alpha')")
    return rotation_from_dict(data["rotation"]) if data.get("rotation") is not None else None


@dataclass(frozen=True)
class RotationWidths:
    """The widths a rotation acts on in one model: hidden (R1), head_dim (R2), intermediate (R4)."""

    hidden: int
    head_dim: int
    intermediate: int
    layers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # {R1/R2/R4/V: names of the linears it touches}
    in_features: dict[str, int] = field(default_factory=dict)  # {linear: input width}, V's widths (one per linear)

    def of(self, rotation: str) -> int:
        """The width ``rotation`` acts on; V: the widest input (each linear's own width is :attr:`in_features`)."""
        if rotation == V:
            return max((self.in_features[n] for n in self.layers.get(V, ())), default=0)
        return {R1: self.hidden, R2: self.head_dim, R4: self.intermediate}[rotation]

    def v_widths(self) -> dict[int, tuple[str, ...]]:
        """{input width: the linears V rotates at that width}."""
        out: dict[int, list[str]] = {}
        for n in self.layers.get(V, ()):
            out.setdefault(self.in_features[n], []).append(n)
        return {w: tuple(ns) for w, ns in out.items()}


def block_of(spec: RotationSpec, rotation: str, width: int) -> int:
    """The order of each Hadamard block of ``rotation`` over ``width``: the head dimension for R2, the plan's
    block size for R1, R4 and V (the whole width without one)."""
    if rotation == R2 or spec.block_size is None:
        return width
    return spec.block_size


__all__ = ["ALL_ROTATIONS", "HADAMARD", "MAX_BLOCK", "MAX_SEED", "R1", "R2", "R4", "RANDOM_HADAMARD", "ROTATIONS",
           "ROTATION_KINDS", "TRANSFORM_KEYS", "V", "RotationSpec", "RotationWidths", "block_of", "rotation_from_dict",
           "transforms_from_dict"]
