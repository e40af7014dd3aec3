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
    per_expert: true                             # optional; an MoE block's experts may differ (default false)
    transforms:                                  # optional; a Hadamard rotation folded in before quantizing
      rotation: {kind: hadamard, rotations: [R1, R2, R4], block_size: 64}   # (quantcore.algorithms.rotation_spec)
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

The routed experts of an MoE block take one scheme by default (vLLM runs the block as one fused MoE layer with one
quantization method). ``per_expert: true`` lets each expert (its gate/up/down, the unit the per-expert sensitivity
measures) take its own, as ModelOpt's per-module search spaces do: an llm-compressor recipe and a compressed-tensors
checkpoint name every expert's layers, so they can hold it; vLLM cannot serve it
(:func:`quantcore.planning.serving.moe_unserved` says so, :func:`quantcore.export.vllm.to_vllm_command` refuses).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from quantcore.algorithms.rotation_spec import RotationSpec, transforms_from_dict
from quantcore.errors import PlanError
from quantcore.errors import format_problems as _format_problems
from quantcore.errors import name_list as _cut
from quantcore.evaluation.kvcache import AUTO as KV_AUTO
from quantcore.evaluation.kvcache import get_kv_format, normalize_kv_skip
from quantcore.models.parallel import AttentionHeads, Parallelism, parse_tp
from quantcore.safeload import load_yaml, read_input, yaml_problem  # noqa: F401 - yaml_problem: re-exported
from quantcore.schemes.fusion import expert_block, expert_blocks, expert_parts, fusion_groups
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import Scheme

PLAN_SOURCE = "the plan file"  # what a plan's text is called in messages when no file name is known
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
             "tensor_parallel", "expert_parallel", "per_expert", "transforms", "rules", "layers")
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
                       ``FP8``, ``FP8_UNSCALED``, ``FP8_E5M2``, ``FP8_ATTN``, ``FP8_ATTN_UNSCALED``,
                       ``FP8_ATTN_HEAD``); not a linear layer, one per plan
    kv_cache_skip:     attention layers whose cache stays in the model's dtype (vLLM's
                       ``--kv-cache-dtype-skip-layers``): decoder layer indices and/or ``"sliding_window"``,
                       as strings; checked against the model by :func:`quantcore.evaluation.kvcache.kv_skip_layers`
    tensor_parallel:   GPUs vLLM splits every layer over (``--tensor-parallel-size``; :mod:`quantcore.models.parallel`):
                       the serving checks then read each GPU's share; 1 by default
    expert_parallel:   an MoE model's routed experts whole, the GPUs sharing them out (``--enable-expert-parallel``)
                       instead of every expert split over the GPUs; False by default
    per_expert:        an MoE block's routed experts may take different schemes, one per expert (its gate/up/down
                       together); False by default (one scheme per block, what vLLM's fused MoE serves)
    rotation:          the plan's Hadamard rotation (its ``transforms: {rotation: ...}``,
                       :class:`~quantcore.algorithms.rotation_spec.RotationSpec`), applied to the whole model before
                       its schemes quantize it; None: none
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
    per_expert: bool = False
    rotation: RotationSpec | None = None
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
        if self.per_expert:
            out["per_expert"] = True
        if self.rotation is not None:
            out["transforms"] = {"rotation": self.rotation.to_dict()}
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
        per_expert = data.get("per_expert", False)
        if per_expert is None:
            per_expert = False
        if not isinstance(per_expert, bool):
            problems.append(f"'per_expert' must be true or false, got {per_expert!r}")
        rotation = None
        try:
            rotation = transforms_from_dict(data.get("transforms"))
        except PlanError as exc:
            problems.append(str(exc))

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
            per_expert=per_expert is True,
            rotation=rotation,
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
    def from_yaml(cls, text: str | bytes, source: str = PLAN_SOURCE) -> PlanSpec:
        """Parse a plan file's text with the bounded loader (:func:`quantcore.safeload.load_yaml`: plain data only,
        no anchors / aliases, a size and a nesting cap, a binary file refused as such); ``source`` names it in
        errors."""
        data = load_yaml(text, source, PlanError)
        if data is None:
            raise PlanError(f"{source} is empty; it needs at least 'default: <scheme>'")
        try:
            return cls.from_dict(data)
        except PlanError as exc:
            if source == PLAN_SOURCE:
                raise
            raise PlanError(f"{source}: {exc}") from None


def load_plan_file(path: str | Path) -> PlanSpec:
    """Read and parse a plan YAML file (structure only; see :func:`resolve_plan`), refused past
    :data:`quantcore.safeload.MAX_PLAN_BYTES` before it is read."""
    text, source = read_input(path, PlanError, what="plan file")
    return PlanSpec.from_yaml(text, source=source)


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
    resolve to one scheme (alpha included), and so must the routed experts of an MoE block (``spec.per_expert``:
    of one expert, its gate/up/down).
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
                f"fix the expression (e.g. {example_names(names)}) or remove the rule"
            )

    explicit: dict[str, Scheme | None] = {}
    for layer, scheme_name in spec.layers.items():
        explicit[layer] = lookup(scheme_name, f"layer {layer!r}")
    unknown_layers = [n for n in _ordered_union(spec.layers, spec.layer_alpha) if n not in known]
    if unknown_layers:
        problems.append(
            f"layer name(s) the model does not have: {_cut(unknown_layers)}; "
            f"names look like {example_names(names)}"
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
        problems += mixed_experts(resolved, names, per_expert=spec.per_expert)
    if problems:
        raise PlanError(_format_problems(_plan_title(spec), problems))
    return resolved


def mixed_experts(resolved: Mapping[str, Scheme | str], names: Sequence[str], *, per_expert: bool = False
                  ) -> list[str]:
    """What mixes schemes where a plan may not: the routed experts of an MoE block (``per_expert``: the layers of
    one expert), one problem each."""
    problems = []
    for block, members in expert_blocks(names).items():
        if per_expert:
            for expert in expert_parts(members):
                schemes = sorted({scheme_label(resolved[m]) for m in expert})
                if len(schemes) > 1:
                    where = expert[0].rsplit(".", 1)[0]
                    mix = ", ".join(f"{m.rsplit('.', 1)[-1]}={scheme_label(resolved[m])}" for m in expert)
                    problems.append(
                        f"expert {where} mixes schemes ({mix}); a per-expert plan gives each expert one scheme "
                        "(its gate/up/down, the unit the per-expert sensitivity measures)"
                        f": a rule such as {{match: '{re.escape(where)}\\.', scheme: ...}}"
                    )
            continue
        schemes = sorted({scheme_label(resolved[m]) for m in members})
        if len(schemes) > 1:
            problems.append(
                f"the experts of {block} mix schemes ({', '.join(schemes)}); vLLM runs every expert and "
                "projection of an MoE block as one fused MoE layer with one quantization method, so give "
                f"them one scheme (a rule such as {{match: '{re.escape(block)}\\.', scheme: ...}}), or set "
                "per_expert: true to let each expert take its own (an llm-compressor recipe holds it; vLLM "
                "cannot serve it)"
            )
    return problems


def _mixed_fusion_groups(groups: Sequence[Sequence[str]], resolved: Mapping[str, Scheme],
                         names: Sequence[str]) -> list[str]:
    """One problem per way fusion groups mix schemes: a rule that matched q_proj alone mixes every block's q/k/v
    the same way, which is one message naming the groups and a rule that sets exactly those groups whole
    (quantcore.schemes.targets.compact_targets over ``names``), not one message per block. Groups that differ only in
    their SmoothQuant alphas are told to share one alpha (no scheme rule mends that)."""
    from quantcore.schemes.targets import compact_targets  # export builds on this module

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
    per_expert = any(len({scheme_label(plan[m]) for m in members}) > 1 for members in expert_blocks(plan).values())
    return PlanSpec(model=model, default=default, layers=layers, layer_alpha=alphas, name=name, per_expert=per_expert)


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


def pareto_front(points: Sequence[tuple[float | None, float]]) -> list[bool]:
    """Which ``(cost, loss)`` points no other point beats (both lower is better).

    A point is on the front when no other point has a cost and a loss each at most its own
    and one of them strictly lower. Equal points are all on the front (neither beats the
    other). A point without a cost (``None`` or NaN: say, a plan with no measured kernel
    time) is never on the front and beats nothing.
    """

    def known(cost: float | None) -> TypeGuard[float]:
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
    if len(blocks) == 1 and None not in blocks and len({g.rsplit(".", 2)[-2] for g in group}) > 1:  # several experts
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


def example_names(names: Sequence[str]) -> str:
    """The first three of ``names``, for a message that shows what names look like."""
    return _cut(list(names)[:3]) if names else "(the model has no quantizable layers)"


def _plan_title(spec: PlanSpec) -> str:
    label = f"plan {spec.name!r}" if spec.name else "the plan"
    if spec.model:
        label += f" for {spec.model}"
    return label[0].upper() + label[1:] + " cannot be applied"

