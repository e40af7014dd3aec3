"""Plan files: which quantization scheme every linear layer of a model gets.

Torch-free (pure Python + PyYAML): the Streamlit app reads, edits, validates and
exports plans without importing torch.

The plan file is YAML, the same format the UI saves and exports::

    model: HuggingFaceTB/SmolLM2-135M-Instruct   # id or name of the model it was made for
    name: fp8-but-keep-head                      # optional
    description: FP8 everywhere, lm_head in BF16 # optional
    default: FP8                                 # scheme of every layer no rule names
    smoothquant_alpha: 0.5                       # optional; alpha of every SmoothQuant scheme
    kv_cache: FP8                                # optional; how K and V are cached (default AUTO)
    kv_cache_skip: [sliding_window, 0]           # optional; layers whose cache stays in the model's dtype
    tensor_parallel: 2                           # optional; GPUs vLLM splits each layer over (default 1)
    expert_parallel: true                        # optional; MoE experts whole, one GPU each (default false)
    rules:                                       # in order; the LAST matching rule wins
      - match: 'mlp\\.down_proj$'                # Python regular expression, re.search on the layer name
        scheme: INT8_W8A8_SQ
    layers:                                      # explicit overrides; win over rules
      lm_head: BF16
      model.layers.0.mlp.down_proj: {scheme: INT8_W8A8_SQ, smoothquant_alpha: 0.75}
      model.layers.1.mlp.down_proj: {smoothquant_alpha: 0.6}   # alpha only, scheme from rules

Resolution (:func:`resolve_plan`) gives every layer a :class:`~quantcore.schemes.specs.Scheme`:
``default`` first, then each rule in file order (a later match overrides an earlier
one), then the explicit ``layers`` entries. SmoothQuant alpha: the global
``smoothquant_alpha`` replaces the preset alpha of every scheme that smooths
(``scheme.smoothquant_alpha is not None``) and leaves other schemes alone; a
per-layer alpha overrides it for that layer and may also turn smoothing on for a
scheme that quantizes activations. Weight-only and identity schemes cannot be
smoothed (there is no activation quantizer to help), so an alpha on such a layer is
an error.

Every problem in a plan is reported at once, in one :class:`~quantcore.errors.PlanError`:
unknown scheme names, invalid regular expressions, rules that match no layer, layer
names the model does not have, alphas outside [0, 1], and (by default) fusion groups
(q/k/v, gate/up of one block) whose members resolve to different schemes, since a
serving engine runs such a group as one GEMM with one format.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from quantcore.errors import PlanError
from quantcore.errors import format_problems as _format_problems
from quantcore.errors import name_list as _cut
from quantcore.evaluation.kvcache import AUTO as KV_AUTO
from quantcore.evaluation.kvcache import get_kv_format, normalize_kv_skip
from quantcore.models.parallel import ONE_GPU, AttentionHeads, Parallelism, parse_tp, partition
from quantcore.models.parallel import ROW as TP_ROW
from quantcore.schemes.specs import (
    IDENTITY_BITS,
    Granularity,
    Scheme,
    expert_block,
    expert_blocks,
    fusion_groups,
    fusion_units,
    get_scheme,
    list_schemes,
    weight_storage_bits,
)

# Unicode line breaks that PyYAML writes raw inside a quoted scalar and reads back as a space
_YAML_BREAKS = ("\x85", "\u2028", "\u2029")


def _represent_text(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = '"' if any(b in data for b in _YAML_BREAKS) else None  # double quotes escape them: \N \L \P
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


class TextDumper(yaml.SafeDumper):
    """SafeDumper whose strings survive a round trip whatever they hold (found by Hypothesis:
    a description of "\\x85" came back as " ")."""


TextDumper.add_representer(str, _represent_text)

DEFAULT_SCHEME = "BF16"  # the identity scheme: the layer stays in the model's own precision
ALPHA_MIN = 0.0  # SmoothQuant's alpha: 0 keeps all difficulty on activations ...
ALPHA_MAX = 1.0  # ... 1 moves all of it onto the weights; the paper uses 0.5-0.85

_TOP_KEYS = ("model", "name", "description", "default", "smoothquant_alpha", "kv_cache", "kv_cache_skip",
             "tensor_parallel", "expert_parallel", "rules", "layers")
_RULE_KEYS = ("match", "scheme")
_LAYER_KEYS = ("scheme", "smoothquant_alpha")


@dataclass(frozen=True)
class Rule:
    """One plan rule: every layer whose name matches ``match`` (``re.search``) gets ``scheme``."""

    match: str
    scheme: str

    def to_dict(self) -> dict[str, str]:
        return {"match": self.match, "scheme": self.scheme}


@dataclass
class PlanSpec:
    """A plan as a person writes it: a default scheme, ordered rules and explicit overrides.

    model:             id or name of the model the plan was made for (informative; ``None`` if unknown)
    default:           scheme name of every layer that no rule or override names
    rules:             ordered rules; for a layer, the last matching rule wins over earlier ones
    layers:            ``{layer name: scheme name}`` overrides; win over rules
    smoothquant_alpha: global alpha for every scheme that smooths (``None``: each preset's own)
    layer_alpha:       ``{layer name: alpha}``; wins over the global alpha for that layer
    kv_cache:          how the serving engine stores K and V (:mod:`quantcore.evaluation.kvcache`: ``AUTO``,
                       ``FP8``, ``FP8_UNSCALED``, ``FP8_E5M2``, ``FP8_ATTN``, ``FP8_ATTN_UNSCALED``, ``FP8_ATTN_HEAD``); not a
                       linear layer, one per plan
    kv_cache_skip:     attention layers whose cache stays in the model's dtype (vLLM's
                       ``--kv-cache-dtype-skip-layers``): decoder layer indices and/or ``"sliding_window"``,
                       as strings; checked against the model by :func:`quantcore.evaluation.kvcache.kv_skip_layers`
    tensor_parallel:   GPUs vLLM splits every layer over (``--tensor-parallel-size``; :mod:`quantcore.models.parallel`):
                       the serving checks then read each GPU's share; 1 by default
    expert_parallel:   an MoE model's routed experts whole, the GPUs sharing them out (``--enable-expert-parallel``)
                       instead of every expert split over the GPUs; False by default
    name, description: free text for people
    """

    model: str | None = None
    default: str = DEFAULT_SCHEME
    rules: list[Rule] = field(default_factory=list)
    layers: dict[str, str] = field(default_factory=dict)
    smoothquant_alpha: float | None = None
    layer_alpha: dict[str, float] = field(default_factory=dict)
    kv_cache: str = KV_AUTO
    kv_cache_skip: list[str] = field(default_factory=list)
    tensor_parallel: int = 1
    expert_parallel: bool = False
    name: str | None = None
    description: str = ""

    # ------------------------------------------------------------------ dict / YAML

    def to_dict(self) -> dict[str, Any]:
        """Canonical plain-data form (the YAML file's content); ``from_dict`` inverts it exactly.

        Optional keys (``name``, ``description``, ``smoothquant_alpha``, ``kv_cache``,
        ``kv_cache_skip``, ``tensor_parallel``, ``expert_parallel``) appear only when set (``kv_cache`` when not
        ``AUTO``; layer indices of ``kv_cache_skip`` as integers; ``tensor_parallel`` above 1; ``expert_parallel``
        when true);
        a layer with an alpha is written ``{scheme: X, smoothquant_alpha: a}`` (or
        ``{smoothquant_alpha: a}`` when only the alpha is overridden).
        """
        out: dict[str, Any] = {"model": self.model}
        if self.name is not None:
            out["name"] = self.name
        if self.description:
            out["description"] = self.description
        out["default"] = self.default
        if self.smoothquant_alpha is not None:
            out["smoothquant_alpha"] = self.smoothquant_alpha
        if self.kv_cache != KV_AUTO:
            out["kv_cache"] = self.kv_cache
        if self.kv_cache_skip:
            out["kv_cache_skip"] = [int(e) if e.isdigit() else e for e in self.kv_cache_skip]
        if self.tensor_parallel != 1:
            out["tensor_parallel"] = self.tensor_parallel
        if self.expert_parallel:
            out["expert_parallel"] = True
        out["rules"] = [r.to_dict() for r in self.rules]
        layers: dict[str, Any] = {}
        for layer in _ordered_union(self.layers, self.layer_alpha):
            if layer in self.layer_alpha:
                entry: dict[str, Any] = {}
                if layer in self.layers:
                    entry["scheme"] = self.layers[layer]
                entry["smoothquant_alpha"] = self.layer_alpha[layer]
                layers[layer] = entry
            else:
                layers[layer] = self.layers[layer]
        out["layers"] = layers
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanSpec:
        """Build from the plain-data form; structural problems raise :class:`PlanError`.

        Only the *shape* is checked here (keys, types); scheme and layer names are
        checked against the scheme registry and the model by :func:`resolve_plan`.
        """
        if not isinstance(data, Mapping):
            raise PlanError(
                f"a plan must be a mapping with keys {', '.join(_TOP_KEYS)}; got {type(data).__name__}"
            )
        problems: list[str] = []
        unknown = [k for k in data if k not in _TOP_KEYS]
        if unknown:
            problems.append(
                f"unknown top-level key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(_TOP_KEYS)}"
            )
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            problems.append(f"'model' must be a string (model id or name), got {model!r}")
        name = data.get("name")
        if name is not None and not isinstance(name, str):
            problems.append(f"'name' must be a string, got {name!r}")
        description = data.get("description", "")
        if description is None:
            description = ""
        if not isinstance(description, str):
            problems.append(f"'description' must be a string, got {description!r}")
        default = data.get("default", DEFAULT_SCHEME)
        if not isinstance(default, str) or not default:
            problems.append(f"'default' must be a scheme name such as 'FP8', got {default!r}")
        alpha = _parse_alpha(data.get("smoothquant_alpha"), "smoothquant_alpha", problems)
        kv_cache = KV_AUTO
        kv_unknown = False  # a misspelt format: said once, not again through kv_cache_skip
        if data.get("kv_cache") is not None:
            try:
                kv_cache = get_kv_format(data["kv_cache"]).name
            except PlanError as exc:
                problems.append(f"'kv_cache': {exc}")
                kv_unknown = True
        kv_skip: list[str] = []
        raw_skip = data.get("kv_cache_skip")
        if raw_skip is not None:
            if not isinstance(raw_skip, (list, tuple)):
                raw_skip = [raw_skip]
            try:
                kv_skip = normalize_kv_skip(raw_skip)
            except PlanError as exc:
                problems.append(f"'kv_cache_skip': {exc}")
            if kv_skip and kv_cache == KV_AUTO and not kv_unknown:
                problems.append("'kv_cache_skip' keeps layers out of a quantized KV cache, but 'kv_cache' is AUTO "
                                "(nothing is quantized); set kv_cache or drop kv_cache_skip")
        tp = 1
        if data.get("tensor_parallel") is not None:
            try:
                tp = parse_tp(data["tensor_parallel"])
            except PlanError as exc:
                problems.append(f"'tensor_parallel': {exc}")
        ep = data.get("expert_parallel", False)
        if ep is None:
            ep = False
        if not isinstance(ep, bool):
            problems.append(f"'expert_parallel' must be true or false, got {ep!r}")

        rules: list[Rule] = []
        raw_rules = data.get("rules") or []
        if not isinstance(raw_rules, list):
            problems.append("'rules' must be a list of {match: <regex>, scheme: <name>} entries")
            raw_rules = []
        for i, raw in enumerate(raw_rules, start=1):
            if not isinstance(raw, Mapping) or set(raw) != set(_RULE_KEYS):
                problems.append(f"rule {i} must be {{match: <regex>, scheme: <name>}}, got {raw!r}")
                continue
            if not isinstance(raw["match"], str) or not isinstance(raw["scheme"], str):
                problems.append(f"rule {i}: 'match' and 'scheme' must be strings, got {dict(raw)!r}")
                continue
            rules.append(Rule(match=raw["match"], scheme=raw["scheme"]))

        layers: dict[str, str] = {}
        layer_alpha: dict[str, float] = {}
        raw_layers = data.get("layers") or {}
        if not isinstance(raw_layers, Mapping):
            problems.append(
                "'layers' must be a mapping {<layer name>: <scheme> | {scheme, smoothquant_alpha}}"
            )
            raw_layers = {}
        for layer, entry in raw_layers.items():
            if not isinstance(layer, str):
                problems.append(f"layer name {layer!r} must be a string")
                continue
            if isinstance(entry, str):
                layers[layer] = entry
            elif isinstance(entry, Mapping) and entry and set(entry) <= set(_LAYER_KEYS):
                if "scheme" in entry:
                    if not isinstance(entry["scheme"], str):
                        problems.append(
                            f"layer {layer!r}: 'scheme' must be a string, got {entry['scheme']!r}"
                        )
                    else:
                        layers[layer] = entry["scheme"]
                if "smoothquant_alpha" in entry:
                    a = _parse_alpha(
                        entry["smoothquant_alpha"], f"layer {layer!r} smoothquant_alpha", problems
                    )
                    if a is not None:
                        layer_alpha[layer] = a
            else:
                problems.append(
                    f"layer {layer!r} must map to a scheme name or to "
                    f"{{scheme: <name>, smoothquant_alpha: <0..1>}}, got {entry!r}"
                )
        if problems:
            raise PlanError(_format_problems("This plan file is malformed", problems))
        return cls(
            model=model,
            default=default,
            rules=rules,
            layers=layers,
            smoothquant_alpha=alpha,
            layer_alpha=layer_alpha,
            kv_cache=kv_cache,
            kv_cache_skip=kv_skip,
            tensor_parallel=tp,
            expert_parallel=ep is True,
            name=name,
            description=description,
        )

    def parallelism(self, heads: AttentionHeads | None = None) -> Parallelism:
        """The plan's GPUs as the serving checks read them, with the model's attention ``heads``."""
        return Parallelism(self.tensor_parallel, heads if self.tensor_parallel > 1 else None, self.expert_parallel)

    def to_yaml(self) -> str:
        """The plan file's text (block style, keys in canonical order)."""
        return yaml.dump(self.to_dict(), Dumper=TextDumper, sort_keys=False, default_flow_style=False,
                         allow_unicode=True)

    @classmethod
    def from_yaml(cls, text: str, source: str = "the plan file") -> PlanSpec:
        """Parse a plan file's text (``yaml.safe_load``: no Python objects are ever built); ``source`` names it in
        errors."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PlanError(f"{source} is not valid YAML: {yaml_problem(exc)}") from exc
        if data is None:
            raise PlanError(f"{source} is empty; it needs at least 'default: <scheme>'")
        return cls.from_dict(data)


def load_plan_file(path: str | Path) -> PlanSpec:
    """Read and parse a plan YAML file (structure only; see :func:`resolve_plan`)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"cannot read plan file {str(p)!r}: {exc.strerror or exc}") from exc
    return PlanSpec.from_yaml(text, source=f"plan file {str(p)!r}")


def yaml_problem(exc: Exception) -> str:
    """A YAML error in one line: the problem, where (line and column, counted from 1), and for the usual mistake
    in a plan, a backslash of a regular expression in a double-quoted string, what to write instead."""
    problem = getattr(exc, "problem", None)
    if not problem:
        return " ".join(str(exc).split())
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    hint = ("; in double quotes a backslash starts an escape: write a regular expression in single quotes "
            "('layers\\.0\\.')" if "escape character" in problem else "")
    return f"{problem}{where}{hint}"


def save_plan_file(spec: PlanSpec, path: str | Path) -> Path:
    """Write ``spec.to_yaml()`` to ``path`` (UTF-8) and return the path."""
    p = Path(path)
    p.write_text(spec.to_yaml(), encoding="utf-8")
    return p


# ---------------------------------------------------------------------- resolution


def kv_label(spec: PlanSpec | Mapping[str, Any]) -> str:
    """A plan's KV cache for people: its format, and the layers that keep the model's dtype
    ("FP8 except sliding_window, 0")."""
    if not isinstance(spec, PlanSpec):
        spec = PlanSpec(kv_cache=get_kv_format(spec.get("kv_cache")).name,
                        kv_cache_skip=normalize_kv_skip(spec.get("kv_cache_skip")))
    if spec.kv_cache == KV_AUTO or not spec.kv_cache_skip:
        return spec.kv_cache
    return f"{spec.kv_cache} except {', '.join(spec.kv_cache_skip)}"


def gpus_label(body: Mapping[str, Any]) -> str:
    """The GPUs a plan body is for, for people: "1 GPU", "4 GPUs", "4 GPUs, experts whole"."""
    tp = int(body.get("tensor_parallel") or 1)
    return f"{tp} GPUs" + (", experts whole" if body.get("expert_parallel") else "") if tp > 1 else "1 GPU"


def resolve_plan(
    spec: PlanSpec, layer_names: Sequence[str], *, enforce_fusion: bool = True
) -> dict[str, Scheme]:
    """Give every layer in ``layer_names`` its :class:`Scheme`, or raise one :class:`PlanError`.

    ``layer_names`` are the quantizable linear layers of the model (names as in
    ``model.named_modules()``). The result has exactly those keys, in that order.
    Order of precedence: ``default`` < rules (later rules win) < ``layers``; alpha:
    preset < global ``smoothquant_alpha`` (smoothing schemes only) < ``layer_alpha``.
    With ``enforce_fusion``, every fusion group (q/k/v, gate/up of a block) must
    resolve to one scheme (alpha included), and so must the routed experts of an MoE block.
    """
    names = list(layer_names)
    known = set(names)
    problems: list[str] = []
    valid = list_schemes()

    cache: dict[str, Scheme | None] = {}

    def lookup(scheme_name: str, where: str) -> Scheme | None:
        if scheme_name not in cache:
            try:
                cache[scheme_name] = get_scheme(scheme_name)
            except (KeyError, ValueError):
                cache[scheme_name] = None
        if cache[scheme_name] is None:
            problems.append(f"unknown scheme {scheme_name!r} ({where}); valid schemes: {', '.join(valid)}")
        return cache[scheme_name]

    default = lookup(spec.default, "default")

    compiled: list[tuple[int, Rule, re.Pattern[str] | None, Scheme | None]] = []
    for i, rule in enumerate(spec.rules, start=1):
        scheme = lookup(rule.scheme, f"rule {i}, match {rule.match!r}")
        try:
            pattern: re.Pattern[str] | None = re.compile(rule.match)
        except re.error as exc:
            problems.append(
                f"rule {i}: {rule.match!r} is not a valid regular expression ({exc}); fix or remove it"
            )
            pattern = None
        compiled.append((i, rule, pattern, scheme))

    for i, rule, pattern, _ in compiled:
        if pattern is not None and not any(pattern.search(n) for n in names):
            problems.append(
                f"rule {i} (match {rule.match!r}) matches no layer of this model; "
                f"fix the expression (e.g. {_example_names(names)}) or remove the rule"
            )

    explicit: dict[str, Scheme | None] = {}
    for layer, scheme_name in spec.layers.items():
        explicit[layer] = lookup(scheme_name, f"layer {layer!r}")
    unknown_layers = [n for n in _ordered_union(spec.layers, spec.layer_alpha) if n not in known]
    if unknown_layers:
        problems.append(
            f"layer name(s) the model does not have: {_cut(unknown_layers)}; "
            f"names look like {_example_names(names)}"
        )
    for where, alpha in [("smoothquant_alpha", spec.smoothquant_alpha), *spec.layer_alpha.items()]:
        if alpha is not None and not ALPHA_MIN <= alpha <= ALPHA_MAX:
            problems.append(
                f"{where}: SmoothQuant alpha {alpha} is outside [{ALPHA_MIN}, {ALPHA_MAX}]; "
                "0.5 is the usual choice, up to 0.85 for models with severe outliers"
            )
    if problems:
        raise PlanError(_format_problems(_plan_title(spec), problems))

    resolved: dict[str, Scheme] = {}
    for layer in names:
        scheme = default
        for _, _, pattern, rule_scheme in compiled:
            if pattern is not None and pattern.search(layer):
                scheme = rule_scheme
        if layer in explicit:
            scheme = explicit[layer]
        assert scheme is not None  # every None was reported above
        if spec.smoothquant_alpha is not None and scheme.smoothquant_alpha is not None:
            scheme = scheme.with_alpha(spec.smoothquant_alpha)
        if layer in spec.layer_alpha:
            if scheme.is_identity or scheme.activations is None:
                problems.append(
                    f"layer {layer!r} has smoothquant_alpha {spec.layer_alpha[layer]} but its scheme "
                    f"{scheme.name} quantizes no activations, so smoothing cannot help; remove the alpha "
                    "or give the layer a scheme that quantizes activations (e.g. INT8_W8A8_SQ)"
                )
            else:
                scheme = scheme.with_alpha(spec.layer_alpha[layer])
        resolved[layer] = scheme

    if enforce_fusion:
        problems += _mixed_fusion_groups(fusion_groups(names), resolved, names)
        for block, members in expert_blocks(names).items():
            schemes = sorted({scheme_label(resolved[m]) for m in members})
            if len(schemes) > 1:
                problems.append(
                    f"the experts of {block} mix schemes ({', '.join(schemes)}); vLLM runs every expert and "
                    "projection of an MoE block as one fused MoE layer with one quantization method, so give "
                    f"them one scheme (a rule such as {{match: '{re.escape(block)}\\.', scheme: ...}})"
                )
    if problems:
        raise PlanError(_format_problems(_plan_title(spec), problems))
    return resolved


def _mixed_fusion_groups(groups: Sequence[Sequence[str]], resolved: Mapping[str, Scheme],
                         names: Sequence[str]) -> list[str]:
    """One problem per way fusion groups mix schemes: a rule that matched q_proj alone mixes every block's q/k/v
    the same way, which is one message naming the groups and a rule that sets exactly those groups whole
    (quantcore.export.targets.compact_targets over ``names``), not one message per block. Groups that differ only in their
    SmoothQuant alphas are told to share one alpha (no scheme rule mends that)."""
    from quantcore.export.targets import compact_targets  # export builds on this module

    mixes: dict[tuple[tuple[str, str], ...], list[Sequence[str]]] = {}
    for group in groups:
        if len({scheme_label(resolved[m]) for m in group}) > 1:
            key = tuple((m.rsplit(".", 1)[-1], scheme_label(resolved[m])) for m in group)
            mixes.setdefault(key, []).append(group)
    out = []
    for key, same in mixes.items():
        first = same[0]
        if len({resolved[m].name for m in first}) == 1:  # one scheme, several alphas
            alphas = ", ".join(f"{leaf}={label}" for leaf, label in key)
            out.append(f"{len(same)} fusion group(s) ({_cut(list(dict.fromkeys(group_label(g) for g in same)), 2)}) "
                       f"mix SmoothQuant alphas ({alphas}); their layers share one input, so one smoothing: give the "
                       "whole group one smoothquant_alpha")
            continue
        if len(same) == 1:
            members = ", ".join(f"{m}={scheme_label(resolved[m])}" for m in first)
            out.append(f"fusion group {group_label(first)} mixes schemes ({members}); a serving engine runs these "
                       "layers as one GEMM, so set them together (one rule or override for the whole group)")
            continue
        targets = compact_targets([m for g in same for m in g], names)
        match = "|".join(t[3:] if t.startswith("re:") else f"^{re.escape(t)}$" for t in targets)
        scheme = next((resolved[m].name for m in first if not resolved[m].is_identity), resolved[first[0]].name)
        out.append(f"{len(same)} fusion groups ({_cut(list(dict.fromkeys(group_label(g) for g in same)), 2)}) mix "
                   f"schemes the same way ({', '.join(f'{leaf}={label}' for leaf, label in key)}); a serving engine "
                   f"runs each group's layers as one GEMM, so set them together: one rule for exactly those groups, "
                   f"such as {{match: '{match}', scheme: {scheme}}}")
    return out


def plan_from_scheme(
    scheme_name: str, layer_names: Sequence[str] | None = None, *, model: str | None = None
) -> PlanSpec:
    """A plan that gives every layer ``scheme_name`` (validated against ``layer_names`` when given)."""
    spec = PlanSpec(model=model, default=scheme_name, name=scheme_name)
    if layer_names is not None:
        resolve_plan(spec, layer_names)
    else:
        try:
            get_scheme(scheme_name)
        except (KeyError, ValueError) as exc:
            raise PlanError(
                f"unknown scheme {scheme_name!r}; valid schemes: {', '.join(list_schemes())}"
            ) from exc
    return spec


def spec_from_plan(
    plan: Mapping[str, Scheme | str], *, model: str | None = None, name: str | None = None
) -> PlanSpec:
    """Compact a resolved per-layer plan into a :class:`PlanSpec` (for saving and export).

    The most common scheme becomes ``default``; every other layer becomes an explicit
    override; an alpha that differs from its preset becomes a per-layer alpha.
    ``resolve_plan(spec_from_plan(p), list(p)) == p`` for every plan of preset schemes
    (with alphas). A scheme that is not a registered preset (or a preset with an
    alpha) cannot be written to a plan file and raises :class:`PlanError`.
    """
    if not plan:
        raise PlanError("the plan is empty: it names no layer, so there is nothing to save")
    base: dict[str, str] = {}
    alphas: dict[str, float] = {}
    for layer, s in plan.items():
        scheme = get_scheme(s) if isinstance(s, str) else s
        try:
            preset = get_scheme(scheme.name)
        except (KeyError, ValueError) as exc:
            raise PlanError(
                f"layer {layer!r} uses scheme {scheme.name!r}, which is not a registered preset; "
                f"a plan file can only name presets ({', '.join(list_schemes())})"
            ) from exc
        if scheme != preset:
            if scheme.smoothquant_alpha is None or preset.with_alpha(scheme.smoothquant_alpha) != scheme:
                raise PlanError(
                    f"layer {layer!r} uses a modified {scheme.name} that a plan file cannot express "
                    "(only the SmoothQuant alpha of a preset may change)"
                )
            alphas[layer] = float(scheme.smoothquant_alpha)
        base[layer] = scheme.name
    default = Counter(base.values()).most_common(1)[0][0]
    layers = {layer: s for layer, s in base.items() if s != default}
    return PlanSpec(model=model, default=default, layers=layers, layer_alpha=alphas, name=name)


def diff_plans(
    a: Mapping[str, Scheme | str], b: Mapping[str, Scheme | str]
) -> list[tuple[str, str | None, str | None]]:
    """Layers whose scheme differs between two resolved plans.

    Returns ``(layer, label in a, label in b)`` for each differing layer, in the order
    of ``a`` then layers only in ``b``; a label is the scheme name with its alpha when
    the alpha differs from the preset's (``"INT8_W8A8_SQ (alpha=0.6)"``), ``None`` when
    the layer is missing from that plan.
    """
    out: list[tuple[str, str | None, str | None]] = []
    for layer in _ordered_union(a, b):
        la = scheme_label(a[layer]) if layer in a else None
        lb = scheme_label(b[layer]) if layer in b else None
        if la != lb:
            out.append((layer, la, lb))
    return out


@dataclass(frozen=True)
class FootprintRow:
    """The weights of the layers that share one scheme: how many, and the bits they are stored in."""

    scheme: str
    layers: int
    params: int
    bits: int

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight element, scales included (4.5 for NVFP4: 4 + an 8-bit scale per 16)."""
        return self.bits / self.params if self.params else 0.0


@dataclass(frozen=True)
class Footprint:
    """Linear-weight memory of a resolved plan (:func:`plan_footprint`).

    rows:      one per scheme, the largest stored size first
    params:    weight elements of every layer counted
    bits:      their stored bits under the plan (elements + scales)
    bf16_bits: the same weights unquantized, 16 bits each
    """

    rows: list[FootprintRow]
    params: int
    bits: int
    bf16_bits: int

    @property
    def ratio(self) -> float:
        """Stored size as a share of BF16 (0.53: the plan keeps 53 % of the 16-bit weight memory)."""
        return self.bits / self.bf16_bits if self.bf16_bits else 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary: totals in bytes and each scheme's share."""
        return {
            "params": self.params,
            "bytes": self.bits / 8,
            "bf16_bytes": self.bf16_bits / 8,
            "ratio": self.ratio,
            "schemes": [
                {"scheme": r.scheme, "layers": r.layers, "params": r.params, "bytes": r.bits / 8,
                 "bits_per_weight": r.bits_per_weight}
                for r in self.rows
            ],
        }


def plan_footprint(
    resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]]
) -> Footprint:
    """Weight memory of a resolved plan, per scheme and in total, next to BF16.

    ``shapes`` maps each layer to its (N, K); every layer of ``resolved`` needs one (a
    ValueError names those without). Sizes come from :func:`quantcore.schemes.specs.weight_storage_bits`:
    the linear weights only (embeddings, norms and biases are not the plan's to change).
    """
    missing = [layer for layer in resolved if layer not in shapes]
    if missing:
        raise ValueError(f"no (N, K) shape for {len(missing)} layer(s): {_cut(missing)}")
    per: dict[str, list[int]] = {}
    for layer, scheme in resolved.items():
        n, k = shapes[layer]
        row = per.setdefault(scheme_label(scheme), [0, 0, 0])
        row[0] += 1
        row[1] += n * k
        row[2] += weight_storage_bits(scheme, n, k)
    rows = sorted((FootprintRow(label, *v) for label, v in per.items()), key=lambda r: (-r.bits, r.scheme))
    params = sum(r.params for r in rows)
    return Footprint(rows, params, sum(r.bits for r in rows), IDENTITY_BITS * params)


def _group_misfit_entries(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                          parallel: Parallelism) -> dict[tuple[str, int, bool], dict[str, Any]]:
    """{(scheme label, group, split over GPUs): {layers, scheme, weights}} of :func:`group_misfits`: the layers whose
    K (or, split, each GPU's K) a group of the scheme does not divide, each with that K, and whether they are
    weights' groups."""
    shards = parallel.shards(shapes)
    misfit: dict[tuple[str, int, bool], dict[str, Any]] = {}
    for layer, scheme in resolved.items():
        scheme = get_scheme(scheme)
        _, k = shapes[layer]
        for spec in (scheme.weights, scheme.activations):
            g = spec.group_size if spec is not None and spec.granularity.value == "group" else None
            if not g:
                continue
            shard = not k % g and spec is scheme.weights and shards[layer][1] % g
            if k % g or shard:
                entry = misfit.setdefault((scheme_label(scheme), g, bool(shard)),
                                          {"layers": {}, "scheme": scheme, "weights": False})
                entry["weights"] = entry["weights"] or spec is scheme.weights
                entry["layers"].setdefault(layer, shards[layer][1] if shard else k)
    return misfit


def group_misfit_layers(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                        parallel: Parallelism = ONE_GPU) -> set[str]:
    """The layers :func:`group_misfits` is about."""
    return {layer for e in _group_misfit_entries(resolved, shapes, parallel).values() for layer in e["layers"]}


def regroup_fixes(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                  parallel: Parallelism = ONE_GPU) -> dict[str, list[str]]:
    """{preset: layers} for the layers of :func:`group_misfits` whose weights' groups do not fit: each layer under the
    preset :func:`regrouped_preset` names for its own K (or each GPU's share), the per-layer choice that mends it
    (W4A16_G64_GPTQ for SmolLM2's 180 layers at K = 576 under W4A16_GPTQ). Layers no preset fits are left out."""
    out: dict[str, list[str]] = {}
    for e in _group_misfit_entries(resolved, shapes, parallel).values():
        if not e["weights"]:
            continue
        alt_for: dict[int, Scheme | None] = {}  # a model has few distinct Ks: each looked up once
        for layer, k in e["layers"].items():
            if k not in alt_for:
                alt_for[k] = regrouped_preset(e["scheme"], {k})
            alt = alt_for[k]
            if alt is not None and layer not in out.setdefault(alt.name, []):
                out[alt.name].append(layer)
    return out


def group_misfits(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                  parallel: Parallelism = ONE_GPU) -> list[str]:
    """What a serving stack will complain about: layers whose K is not a whole number of the scheme's groups.

    quantcore quantizes a last, partial group as it is. For groups of *weights* (W4A16, NVFP4, MXFP4...),
    llm-compressor 0.14's ``oneshot`` refuses the recipe (``validate_group_size_divisibility``: "weight column counts
    not divisible by group_size", unless the modifier sets ``bypass_divisibility_checks``), compressed-tensors warns
    ("group quantization strategy requires strict division ...") and vLLM's Marlin kernels refuse to load such a
    layer (``verify_marlin_supports_shape``: "Weight input_size_per_partition = ... is not divisible by group_size").
    For groups of *activations* alone (FP8_BLOCK's 1 x 128 tiles; its weights are 128 x 128 blocks, which
    llm-compressor and compressed-tensors accept on any K), vLLM quantizes each token's row in groups of 128
    (``per_token_group_quant_fp8``), which asserts K divisible by the group. One message per (scheme, group), naming
    how many layers and which K; an empty list when every group fits.

    Split over ``parallel.tp`` > 1 GPUs a row-parallel layer (o_proj, down_proj) holds K / tp inputs on each GPU
    (:mod:`quantcore.models.parallel`), and a group of weights must not straddle two GPUs: vLLM refuses a shard that is not
    a whole number of groups (``verify_group_size_divides_partition``: "This happens when tensor_parallel_size splits
    the layer input into shards that are not a whole number of quant groups"). Those layers get a message of their
    own, per (scheme, group). (FP8_BLOCK's shards are :func:`fp8_block_misfits`'.)
    """
    tp = parallel.tp
    misfit = _group_misfit_entries(resolved, shapes, parallel)
    out = []
    for (label, g, shard), e in misfit.items():
        kset = set(e["layers"].values())
        ks = ", ".join(map(str, sorted(kset)))
        if shard:
            out.append(f"{label} at tensor_parallel {tp}: each GPU holds K / {tp} = {ks} inputs of {len(e['layers'])} "
                       f"row-parallel layer(s) (e.g. {next(iter(e['layers']))}), not a whole number of groups of {g}: vLLM "
                       "refuses a group split over two GPUs (\"not a whole number of quant groups. Consider reducing "
                       "tensor_parallel_size\"): choose a smaller tensor_parallel or keep those layers in another "
                       f"scheme{_regroup_hint(e['scheme'], kset)}")
            continue
        why = ("llm-compressor's oneshot refuses such a recipe (unless bypass_divisibility_checks) and vLLM's group "
               "kernels (Marlin, CUTLASS W4A8) refuse to load a layer whose K is not divisible by the group"
               if e["weights"] else
               f"llm-compressor accepts the recipe, but vLLM quantizes the activations in groups of {g} along K "
               "(per_token_group_quant_fp8), which needs K divisible by the group")
        out.append(f"{label}: groups of {g} do not divide K of {len(e['layers'])} layer(s) (K = "
                   f"{ks}, e.g. {next(iter(e['layers']))}); {why}: keep those layers in "
                   f"another scheme{_regroup_hint(e['scheme'], kset)}")
    return out


def _regroup_hint(scheme: Scheme, ks: set[int]) -> str:
    """", such as W4A16_G64, whose groups of 64 divide them" (:func:`regrouped_preset`), else ""."""
    best = regrouped_preset(scheme, ks)
    return f", such as {best.name}, {regroup_reason(best)}" if best else ""


def regroup_reason(scheme: Scheme) -> str:
    """Why a preset of :func:`regrouped_preset` fits: "whose groups of 64 divide them" or, for one scale per output
    channel, "with one scale per output channel, which any K takes"."""
    if scheme.weights.granularity is Granularity.GROUP:
        return f"whose groups of {scheme.weights.group_size} divide them"
    return "with one scale per output channel, which any K takes"


def regrouped_preset(scheme: Scheme | str, ks: Iterable[int]) -> Scheme | None:
    """The preset that differs from ``scheme`` only in its weights' group: the largest group size dividing every K
    in ``ks``, else one scale per output channel (no group at all), or None: W4A16_G64_GPTQ for W4A16_GPTQ on
    SmolLM2's K = 576; W4A16_G32_GPTQ at one GPU's 7,392 of Qwen2.5-72B's down_proj; W4A16_CHANNEL_GPTQ at 3,696."""
    scheme = get_scheme(scheme)
    ks = set(ks)
    w = scheme.weights
    if w is None:
        return None
    same = [
        other for other in map(get_scheme, list_schemes())
        if other.weights is not None and other.weights.granularity in (Granularity.GROUP, Granularity.CHANNEL)
        and (other.weights.format, other.weights.symmetric, other.activations, other.gptq, other.awq,
             other.smoothquant_alpha)
        == (w.format, w.symmetric, scheme.activations, scheme.gptq, scheme.awq, scheme.smoothquant_alpha)
    ]
    fits = [o for o in same if o.weights.granularity is Granularity.GROUP and o.weights.group_size != w.group_size
            and all(k % o.weights.group_size == 0 for k in ks)]
    if fits:
        return max(fits, key=lambda s: s.weights.group_size)
    return next((o for o in same if o.weights.granularity is Granularity.CHANNEL and o is not scheme), None)


def fp8_block_misfits(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                      parallel: Parallelism = ONE_GPU) -> list[str]:
    """Block-scaled FP8 layers vLLM refuses to load, one message per cause (or none). Its ``validate_fp8_block_shape``
    checks each layer it builds (q/k/v merged as ``qkv_proj``, gate/up as ``gate_up_proj``):

    - a merged layer on one GPU: every member's N but the last must be a whole number of the blocks' rows ("Weight
      output_partition_size = ... is not divisible by weight quantization block_n"): one member's blocks would
      straddle the next (the last member may end in a partial block);
    - split over ``parallel.tp`` > 1 GPUs, each GPU's share of a column-parallel layer's members, all of them
      (:mod:`quantcore.models.parallel`);
    - split, each GPU's share of a row-parallel layer's K (o_proj, down_proj), a whole number of the blocks' columns
      ("Weight input_size_per_partition = ... is not divisible by weight quantization block_k").

    Its fused MoE layer checks the routed experts' intermediate size on each GPU (``Fp8MoEMethod.create_weights``,
    compressed-tensors' too): a whole number of block rows even on one GPU ("The output_size of gate's and up's
    weight = ... is not divisible by weight quantization block_n"), and of block columns once split ("The input_size
    of down's weight ..."). Expert parallelism keeps every expert whole on one GPU. A dense layer loaded alone takes
    any N on one GPU.
    """
    tp = parallel.tp
    rows, cols, experts, _ = _fp8_block_entries(resolved, shapes, parallel)
    out = []
    at = f" at tensor_parallel {tp}, on each GPU" if tp > 1 else ""
    if rows:
        ns = ", ".join(map(str, sorted({n for _, n, _ in rows})))
        what = ("column-parallel layer(s) (q/k/v and gate/up merged)" if tp > 1 else
                "layer(s) vLLM loads merged with the next (q/k/v, gate/up; the last member may end in a partial block)")
        out.append(f"FP8 blocks of {rows[0][2]} rows do not divide N{at} of {len(rows)} {what} (N = {ns}, e.g. "
                   f"{rows[0][0]}): vLLM's validate_fp8_block_shape refuses them (\"output_partition_size ... is not "
                   "divisible by weight quantization block_n\"), so the checkpoint does not load: keep those layers in "
                   "another scheme" + (" or choose a smaller tensor_parallel" if tp > 1 else ""))
    if cols:
        ks = ", ".join(map(str, sorted({k for _, k, _ in cols})))
        out.append(f"FP8 blocks of {cols[0][2]} columns do not divide K{at} of {len(cols)} row-parallel layer(s) (K = "
                   f"{ks}, e.g. {cols[0][0]}): vLLM's validate_fp8_block_shape refuses them (\"input_size_per_partition "
                   "... is not divisible by weight quantization block_k\"), so the checkpoint does not load: keep "
                   "those layers in another scheme or choose a smaller tensor_parallel")
    if experts:
        sizes = ", ".join(map(str, sorted({i for _, i, _ in experts})))
        fix = ("serve with expert parallelism (--enable-expert-parallel keeps every expert whole on one GPU), a "
               "smaller tensor_parallel, or another scheme for the experts"
               if parallel.split and not parallel.expert_parallel else "keep the experts in another scheme")
        out.append(f"FP8 blocks of {experts[0][2]} do not divide the routed experts' intermediate size{at} in "
                   f"{len(experts)} MoE block(s) ({sizes}, e.g. {experts[0][0]}): vLLM's fused MoE refuses them "
                   f"(\"The output_size of gate's and up's weight = {experts[0][1]} is not divisible by weight "
                   f"quantization block_n\", or block_k for down's input once split), so the checkpoint does not "
                   f"load: {fix}")
    return out


def _fp8_block_entries(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                       parallel: Parallelism = ONE_GPU):
    """What :func:`fp8_block_misfits` says, as entries: (rows, cols, experts, expert layers). rows: (layer, N on a
    GPU, block rows); cols: (layer, K on a GPU, block columns); experts: (expert block, intermediate size on a GPU,
    block size it misses); expert layers: every layer of those blocks' expert units."""
    tp = parallel.tp
    shards = parallel.shards(shapes)
    rows: list[tuple[str, int, int]] = []
    cols: list[tuple[str, int, int]] = []
    experts: list[tuple[str, int, int]] = []
    expert_layers: list[str] = []
    for unit in fusion_units(resolved):
        w = get_scheme(resolved[unit[0]]).weights
        if w is None or w.granularity is not Granularity.BLOCK:
            continue
        block_n, block_k = w.block
        block = expert_block(unit[0])
        if block is not None:
            inter = next((shards[m][0] for m in unit if m.endswith(".gate_proj")), None)
            split = parallel.split and not parallel.expert_parallel
            if inter is not None and (inter % block_n or (split and inter % block_k)):
                experts.append((block, inter, block_n if inter % block_n else block_k))
                expert_layers += list(unit)
            continue
        if tp > 1 and partition(unit[0]) == TP_ROW:
            cols += [(m, shards[m][1], block_k) for m in unit if shards[m][1] % block_k]
            continue
        # vLLM's own test: split over the GPUs when the whole N is tp times the GPU's (k/v heads copied onto
        # several GPUs make it less), else, if merged, every member but the last
        split = tp > 1 and sum(shapes[m][0] for m in unit) // max(1, sum(shards[m][0] for m in unit)) == tp
        members = unit if split else unit[:-1]
        rows += [(m, shards[m][0], block_n) for m in members if shards[m][0] % block_n]
    return rows, cols, experts, expert_layers


def fp8_block_untileable(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                         parallel: Parallelism = ONE_GPU) -> set[str]:
    """The layers :func:`fp8_block_misfits` is about, every member of a fused group (vLLM refuses the merged layer)
    and every layer of an MoE block's refused expert units."""
    rows, cols, _, expert_layers = _fp8_block_entries(resolved, shapes, parallel)
    bad = {m for m, _, _ in rows} | {m for m, _, _ in cols}
    return {m for unit in fusion_units(resolved) if bad.intersection(unit) for m in unit} | set(expert_layers)


W4A8_FP8_TILE = 128  # vLLM's CUTLASS W4A8 kernel: groups of exactly 128, and N and K multiples of 128


def is_w4afp8(scheme: Scheme | str) -> bool:
    """INT4 weights with FP8 (E4M3) activations: the W4AFP8 presets, which only vLLM's CUTLASS W4A8 kernel serves."""
    scheme = get_scheme(scheme)
    return (scheme.weights is not None and scheme.activations is not None
            and scheme.weights.format == "int4" and scheme.activations.format == "fp8_e4m3")


def _w4afp8_untileable(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                       parallel: Parallelism = ONE_GPU) -> list[tuple[list[str], int]]:
    """(layers vLLM loads as one, their N on one GPU) for every W4AFP8 layer, fused as vLLM fuses it, whose N (split
    over ``parallel``'s GPUs, each GPU's share) is not a multiple of 128. Routed experts are left out: vLLM's fused
    MoE layer serves them with its grouped W4A8 kernel."""
    return [(unit, n) for unit, scheme, n, _ in _dense_loaded(resolved, shapes, parallel)
            if is_w4afp8(scheme) and n % W4A8_FP8_TILE]


def _dense_loaded(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                  parallel: Parallelism) -> Iterator[tuple[list[str], Scheme, int, int]]:
    """(layers vLLM loads as one GEMM, their scheme, N, K on one GPU) of every dense unit: q/k/v and gate/up fused
    (N the sum of the members'), every other layer alone; routed experts left out (vLLM's fused MoE loads them)."""
    shards = parallel.shards(shapes)
    for unit in fusion_units(resolved):
        if expert_block(unit[0]) is None:
            yield unit, get_scheme(resolved[unit[0]]), sum(shards[m][0] for m in unit), shards[unit[0]][1]


def w4afp8_untileable(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                      parallel: Parallelism = ONE_GPU) -> set[str]:
    """The W4AFP8 layers :func:`w4afp8_misfits` is about (every member of a fused group)."""
    return {m for group, _ in _w4afp8_untileable(resolved, shapes, parallel) for m in group}


def w4afp8_misfits(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                   parallel: Parallelism = ONE_GPU) -> list[str]:
    """What vLLM's one W4AFP8 kernel refuses, one message (or none): the layers vLLM would load as a whole whose
    output width N is not a multiple of 128.

    vLLM serves INT4 weights with FP8 activations by its CUTLASS W4A8 kernel alone (``CutlassW4A8LinearKernel``,
    Hopper), whose ``can_implement`` wants symmetric groups of exactly 128 and N and K divisible by 128 ("K and N
    must be divisible by 128"), for the layer as vLLM fuses it: q/k/v load as one ``qkv_proj`` and gate/up as one
    ``gate_up_proj``, so their N is the sum (SmolLM2's 576 + 192 + 192 = 960 is not a multiple of 128). Routed
    experts are left out (:func:`_w4afp8_untileable`). A K that 128 does not divide is :func:`group_misfits`'
    message already (each GPU's K at tensor parallelism too). Split over ``parallel.tp`` > 1 GPUs the N is each
    GPU's share of the fused layer.
    """
    tp = parallel.tp
    bad = [(group_label(group), n) for group, n in _w4afp8_untileable(resolved, shapes, parallel)]
    if not bad:
        return []
    ns = sorted({n for _, n in bad})
    at = f" on each GPU at tensor_parallel {tp}" if tp > 1 else ""
    return [f"W4AFP8 on {len(bad)} layer(s) as vLLM loads them (q/k/v and gate/up fused) whose output width N{at} is "
            f"not a multiple of {W4A8_FP8_TILE} (N = {', '.join(map(str, ns))}, e.g. {bad[0][0]}): vLLM's only W4AFP8 "
            f"kernel (CUTLASS W4A8, Hopper) refuses them (\"K and N must be divisible by {W4A8_FP8_TILE}\"), so the "
            "checkpoint does not load: keep those layers in another scheme"
            + (" or choose a smaller tensor_parallel" if tp > 1 else "")]


MARLIN_TILES = ((64, 128), (128, 64))  # (N, K) multiples of Marlin's thread tiles (vLLM's marlin_padded_nk)
MARLIN_WEIGHTS = ("int4", "int8", "nvfp4", "mxfp4")  # weight-only formats vLLM serves with its Marlin kernels


def marlin_untiled(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                   parallel: Parallelism = ONE_GPU) -> list[tuple[list[str], int, int]]:
    """(layers vLLM loads as one, their N, their K on one GPU) for every weight-only layer (INT4, INT8, NVFP4, MXFP4
    with 16-bit activations: vLLM's Marlin kernels; Machete on Hopper wants one of the same shapes) whose shape on a GPU
    fits neither of Marlin's thread tiles: N a multiple of 64 with K a multiple of 128, or N of 128 with K of 64.
    SmolLM2's fused q/k/v (N = 960, K = 576) is one. Routed experts are left out (vLLM's fused MoE)."""
    return [(unit, n, k) for unit, scheme, n, k in _dense_loaded(resolved, shapes, parallel)
            if scheme.activations is None and scheme.weights is not None and scheme.weights.format in MARLIN_WEIGHTS
            and not any(n % tn == 0 and k % tk == 0 for tn, tk in MARLIN_TILES)]


def marlin_misfits(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                   parallel: Parallelism = ONE_GPU) -> list[str]:
    """What :func:`marlin_untiled` means for serving, one message (or none): vLLM since vllm-project/vllm#45295
    (June 2026) zero-pads such a layer to the nearer tile (``marlin_padded_nk``: "Marlin requires thread-tile padding
    for some weight shapes ... performance may be degraded"); earlier releases refuse Marlin there
    (``verify_marlin_supports_shape``: "... is not divisible by min_thread_k = 128. Consider reducing
    tensor_parallel_size"), and their other kernels for 16-bit activations mostly want float16 (Exllama: "Exllama
    only supports float16 activations")."""
    bad = marlin_untiled(resolved, shapes, parallel)
    if not bad:
        return []
    shown = ", ".join(f"{n} x {k}" for n, k in sorted({(n, k) for _, n, k in bad}))
    first = group_label(bad[0][0])
    at = f" on each of {parallel.tp} GPUs" if parallel.split else ""
    return [f"Marlin tiles: {len(bad)} weight-only layer(s) as vLLM loads them (q/k/v and gate/up fused) have an N x K"
            f"{at} that fits neither of its thread tiles (N a multiple of 64 with K of 128, or N of 128 with K of 64): "
            f"{shown} (e.g. {first}). vLLM since June 2026 (vllm-project/vllm#45295) pads them, which costs some "
            "speed; earlier releases refuse Marlin there (\"is not divisible by min_thread_k = 128\") and fall back "
            "to kernels that mostly want float16 activations (Exllama), so a bfloat16 checkpoint may not load: "
            "check your vLLM, or keep those layers in another scheme"]


AWQ_FOLDABLE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "o_proj")  # quantcore.algorithms.awq


def awq_unscaled(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]]) -> list[str]:
    """Why some layers planned with AWQ will be rounded unscaled, one message (or none).

    AWQ folds 1/s into the operator before a layer (:mod:`quantcore.algorithms.awq`): a layer with none (lm_head, a
    projection outside the Llama-style blocks) or an o_proj under grouped-query attention (v_proj has fewer
    outputs than o_proj has inputs; llm-compressor's AWQModifier skips that mapping too) is rounded to nearest
    without scaling: the plan still serves, it just gains nothing from AWQ there.
    """
    lost: list[str] = []
    for layer, scheme in resolved.items():
        if not get_scheme(scheme).needs_awq:
            continue
        head, _, leaf = layer.rpartition(".")
        v = shapes.get(f"{head}.v_proj")
        if leaf not in AWQ_FOLDABLE or (leaf == "o_proj" and (v is None or v[0] != shapes[layer][1])):
            lost.append(layer)
    if not lost:
        return []
    return [f"AWQ cannot scale {len(lost)} layer(s) ({_example_names(lost)}): nothing before them takes the "
            "factors (lm_head), or v_proj has fewer outputs than o_proj has inputs (grouped-query attention); "
            "they are rounded to nearest unscaled, as llm-compressor's AWQModifier leaves them"]


def untied_embedding_bits(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                          tied: Iterable[str]) -> int:
    """Bits a serving checkpoint adds when the plan quantizes a linear whose weight the model ties to its input
    embeddings (``tied``: lm_head under ``tie_word_embeddings``). llm-compressor unties them before it quantizes
    such a head (``untie_word_embeddings``): the embedding stays in 16 bits beside the quantized head, where the
    unquantized model stored one matrix for both."""
    return sum(IDENTITY_BITS * shapes[name][0] * shapes[name][1] for name in tied
               if name in resolved and not get_scheme(resolved[name]).is_identity)


def quantized_head(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]],
                   tied: Iterable[str]) -> list[str]:
    """What serving a quantized lm_head runs into, one message (or none): serving engines load it from a
    compressed-tensors checkpoint only lately, and a head tied to the input embeddings comes untied, which costs
    the embedding's memory again (:func:`untied_embedding_bits`)."""
    heads = [n for n in resolved if n.rsplit(".", 1)[-1] == "lm_head" and not get_scheme(resolved[n]).is_identity]
    if not heads:
        return []
    scheme = scheme_label(get_scheme(resolved[heads[0]]))
    msg = (f"lm_head is quantized ({scheme}): check that your serving engine loads a quantized head; vLLM's "
           "compressed-tensors loader routes lm_head to its quantized kernels only since March 2026 "
           "(vllm-project/vllm#37291; before, it did not read the head's quantized weights), SGLang since August 2026, "
           "and llm-compressor's own examples keep it in BF16 (ignore: [lm_head])")
    untied = untied_embedding_bits(resolved, shapes, tied)
    if untied:
        msg += (f". The model ties lm_head to its input embeddings: llm-compressor unties them, so the checkpoint "
                f"keeps the embedding in BF16 beside the quantized head, {untied / 8 / 2**20:,.1f} MiB more than the "
                "linear weights show (the serving memory counts it)")
    return [msg]


def moe_unserved(resolved: Mapping[str, Scheme | str]) -> list[str]:
    """MoE blocks whose experts' scheme vLLM's fused MoE layer has no method for, one message (or none).

    vLLM's compressed-tensors loader picks one method per MoE block (``CompressedTensorsMoEMethod.get_moe_method``)
    from: weight-only int (WNA16), MXFP4, NVFP4 / NVFP4A16, FP8 W8A8 with tensor, channel or block weight
    scales, INT8 W8A8 with per-token dynamic activations, and W4A8; anything else raises "Unsupported FusedMoe
    scheme" when the checkpoint loads. Of quantplan's schemes that leaves out INT8 with per-tensor activations
    and MXFP8.
    """
    unserved: dict[str, list[str]] = {}
    for block, members in _unserved_expert_blocks(resolved).items():
        unserved.setdefault(scheme_label(get_scheme(resolved[members[0]])), []).append(block)
    return [f"vLLM's fused MoE layer has no kernel for {label} experts ({_example_names(blocks)}): loading the "
            "checkpoint fails with \"Unsupported FusedMoe scheme\". It serves experts in weight-only int "
            "(W4A16, W8A16), MXFP4, NVFP4, FP8 W8A8 and INT8 W8A8 with per-token activations; give those blocks "
            "one of them" for label, blocks in unserved.items()]


def _unserved_expert_blocks(resolved: Mapping[str, Scheme | str]) -> dict[str, list[str]]:
    """{MoE block: its expert linears} of the blocks whose experts' scheme vLLM's fused MoE has no method for."""
    out = {}
    for block, members in expert_blocks(resolved).items():
        scheme = get_scheme(resolved[members[0]])
        w, a = scheme.weights, scheme.activations
        if w is None or a is None:
            continue
        if (w.format == "int8" and not (a.granularity is Granularity.TOKEN and a.dynamic)) or w.format == "mxfp8":
            out[block] = list(members)
    return out


def _dense_dynamic_per_tensor(resolved: Mapping[str, Scheme | str], fmt: str) -> list[str]:
    """Dense layers (not routed experts) whose activations are ``fmt`` on a dynamic per-tensor scale."""
    out = []
    for layer, scheme in resolved.items():
        a = get_scheme(scheme).activations
        if (a is not None and expert_block(layer) is None and a.granularity is Granularity.TENSOR and a.dynamic
                and a.format == fmt):
            out.append(layer)
    return out


def vllm_unloadable(resolved: Mapping[str, Scheme | str]) -> list[str]:
    """Layers of ``resolved`` that vLLM has no kernel for, so a checkpoint with them does not load: dense layers in
    INT8 with *dynamic per-tensor* activation scales (INT8_PER_TENSOR, INT8_PER_TENSOR_SQ: the compressed-tensors
    loader, :func:`vllm_activation_misfits`), and the experts of MoE blocks in a scheme the fused MoE has no method
    for (INT8 without per-token activations, MXFP8: :func:`moe_unserved`)."""
    experts = [m for members in _unserved_expert_blocks(resolved).values() for m in members]
    return _dense_dynamic_per_tensor(resolved, "int8") + experts


def vllm_activation_misfits(resolved: Mapping[str, Scheme | str], *, online_fp8: bool = False) -> list[str]:
    """Dense layers whose activation quantization vLLM's compressed-tensors loader does not run as scored, one
    message per kind (or none).

    - INT8 with *dynamic per-tensor* activations (INT8_PER_TENSOR, INT8_PER_TENSOR_SQ): vLLM's INT8 W8A8 takes static
      per-tensor (calibrated) or dynamic per-token activation scales only; anything else raises "No compressed-tensors
      compatible scheme was found" when the checkpoint loads.
    - FP8 with dynamic per-tensor activations (FP8_PER_TENSOR) in a checkpoint: vLLM's CompressedTensorsW8A8Fp8
      quantizes every dynamic FP8 activation per token, so it serves those layers better than scored. Its online
      ``--quantization fp8`` (``online_fp8``: the plan is FP8_PER_TENSOR throughout) does quantize per tensor.

    Routed experts are :func:`moe_unserved`'s business (vLLM's fused MoE reads per-tensor scales as planned).
    """
    int8 = _dense_dynamic_per_tensor(resolved, "int8")
    fp8 = [] if online_fp8 else _dense_dynamic_per_tensor(resolved, "fp8_e4m3")
    out = []
    if int8:
        out.append(f"INT8 with dynamic per-tensor activations on {len(int8)} layer(s) ({_example_names(int8)}): vLLM's "
                   "compressed-tensors loader has no kernel for it (\"No compressed-tensors compatible scheme was "
                   "found\"); its INT8 W8A8 takes calibrated per-tensor or dynamic per-token activation scales "
                   "(INT8_W8A8, INT8_W8A8_SQ), so the checkpoint does not load")
    if fp8:
        out.append(f"FP8 with dynamic per-tensor activations on {len(fp8)} layer(s) ({_example_names(fp8)}), in a "
                   "checkpoint: vLLM quantizes dynamic FP8 activations per token there, which is better than this "
                   "score measured (per tensor); only its online --quantization fp8, for a plan that is "
                   "FP8_PER_TENSOR throughout, quantizes them per tensor")
    return out


def pareto_front(points: Sequence[tuple[float | None, float]]) -> list[bool]:
    """Which ``(cost, loss)`` points no other point beats (both lower is better).

    A point is on the front when no other point has a cost and a loss each at most its own
    and one of them strictly lower. Equal points are all on the front (neither beats the
    other). A point without a cost (``None`` or NaN: say, a plan with no measured kernel
    time) is never on the front and beats nothing.
    """

    def known(cost: float | None) -> bool:
        return cost is not None and cost == cost  # NaN != NaN

    out = []
    for i, (cost, loss) in enumerate(points):
        out.append(known(cost) and not any(
            known(c) and c <= cost and q <= loss and (c < cost or q < loss)
            for j, (c, q) in enumerate(points) if j != i
        ))
    return out


def scheme_label(scheme: Scheme | str) -> str:
    """Scheme name, plus ``(alpha=a)`` when its SmoothQuant alpha differs from the preset's."""
    if isinstance(scheme, str):
        return scheme
    try:
        preset = get_scheme(scheme.name)
    except (KeyError, ValueError):
        preset = None
    if scheme.smoothquant_alpha is not None and (
        preset is None or preset.smoothquant_alpha != scheme.smoothquant_alpha
    ):
        return f"{scheme.name} (alpha={scheme.smoothquant_alpha:g})"
    return scheme.name


def group_label(group: Sequence[str]) -> str:
    """Short label of a fusion group: ``model.layers.3.self_attn.{q,k,v}_proj``.

    The common prefix and suffix of the member names are kept, the differing middle
    parts are listed in braces. A single layer is labelled by its own name.
    """
    if len(group) == 1:
        return group[0]
    blocks = {expert_block(g) for g in group}
    if len(blocks) == 1 and None not in blocks:
        return f"{blocks.pop()}.* ({len(group)} expert linears)"
    prefix = _common_prefix(group)
    suffix = _common_prefix([g[len(prefix) :][::-1] for g in group])[::-1]
    middles = [g[len(prefix) : len(g) - len(suffix)] for g in group]
    if any(not m for m in middles):
        return "{" + ",".join(group) + "}"
    return f"{prefix}{{{','.join(middles)}}}{suffix}"


# ---------------------------------------------------------------------- helpers


def _common_prefix(strings: Sequence[str]) -> str:
    first, last = min(strings), max(strings)
    i = 0
    while i < min(len(first), len(last)) and first[i] == last[i]:
        i += 1
    return first[:i]


def _parse_alpha(value: Any, where: str, problems: list[str]) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        problems.append(f"{where} must be a number in [{ALPHA_MIN}, {ALPHA_MAX}], got {value!r}")
        return None
    return float(value)


def _ordered_union(*mappings: Mapping[str, Any]) -> list[str]:
    seen: dict[str, None] = {}
    for m in mappings:
        for k in m:
            seen.setdefault(k, None)
    return list(seen)



def _example_names(names: Sequence[str]) -> str:
    return _cut(list(names)[:3]) if names else "(the model has no quantizable layers)"


def _plan_title(spec: PlanSpec) -> str:
    label = f"plan {spec.name!r}" if spec.name else "the plan"
    if spec.model:
        label += f" for {spec.model}"
    return label[0].upper() + label[1:] + " cannot be applied"

