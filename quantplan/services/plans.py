"""Stored plans and their resolution on a model: versions, saving, the resolved schemes, weight memory."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from quantplan.services import access
from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from quantplan.services.models import attention_heads, layer_names, layer_shapes
from store import repo
from store.db import session_scope
from store.records import ModelRecord, PlanRecord
from store.removal import refuse_removed

if TYPE_CHECKING:
    from quantcore.models.parallel import Parallelism
    from quantcore.planning.footprint import Footprint
    from quantcore.schemes.specs import Scheme


def list_plans(model_id: int | None = None) -> list[PlanRecord]:
    """Every stored plan version (of one model, where given), oldest first."""
    with session_scope(settings()) as s:
        return repo.list_plans(s, model_id)


def save_plan(model_id: int, name: str, body: dict[str, Any], note: str = "",
              parent_id: int | None = None) -> PlanRecord:
    """Save ``body`` as the next version of plan ``name`` of the model, by the current user; Refused without a
    name or for a removed model; access.Forbidden for a viewer."""
    user = access.require("save_plan").name
    if not name.strip():
        raise Refused("a plan needs a name: its versions are saved, listed and exported under it")
    with session_scope(settings()) as s:
        if (refusal := refuse_removed(repo.get_model(s, model_id), "a new plan version")) is not None:
            raise Refused(refusal)
        return repo.save_plan(s, model_id=model_id, name=name, body=body, user=user, note=note,
                              parent_id=parent_id)


def new_plan_body(model: ModelRecord, default: str) -> dict[str, Any]:
    """A new plan of ``default`` on every layer, lm_head (where the model has one: not an encoder) kept in BF16."""
    head = [{"match": "lm_head", "scheme": "BF16"}] if "lm_head" in layer_names(model) else []
    return {"model": model.name, "default": default, "rules": head}


def unchanged_version(model_id: int, name: str, body: dict[str, Any]) -> PlanRecord | None:
    """The newest version of plan ``name`` when its body is ``body`` already: saving it again would only repeat it."""
    versions = [p for p in list_plans(model_id) if p.name == name]
    return versions[-1] if versions and versions[-1].body == body else None


def save_layer_alpha(model: ModelRecord, plan_name: str, layer: str, alpha: float,
                     base: PlanRecord | None, scheme: str = "INT8_W8A8") -> PlanRecord:
    """A new version of plan_name with this SmoothQuant alpha for `layer` and its fusion group
    (layers fused at serving time share one input, so they must share the smoothing). Without a base plan, a new plan
    of `scheme` on every layer (default INT8_W8A8: INT8 with dynamic per-token activations) carries the alpha; with
    one, the layer keeps the base plan's scheme (:func:`alpha_scheme` says which)."""
    from quantcore.planning.plans import PlanSpec
    from quantcore.schemes.fusion import fusion_group_of

    names = layer_names(model)
    spec = PlanSpec.from_dict(base.body if base else {**new_plan_body(model, scheme), "name": plan_name})
    for member in fusion_group_of(layer, names) or [layer]:
        spec.layer_alpha[member] = float(alpha)
    body = spec.to_dict()
    _, problem = resolve(model, body)
    if problem:  # e.g. the layer's scheme quantizes no activations: nothing to smooth, and no plan to save
        raise Refused(problem)
    return save_plan(model.id, plan_name, body, note=f"alpha {alpha:.2f} for {layer}",
                     parent_id=base.id if base else None)


def alpha_scheme(model: ModelRecord, base: PlanRecord | None, layer: str, scheme: str = "INT8_W8A8") -> Scheme:
    """The scheme :func:`save_layer_alpha` smooths `layer` under: the base plan's for the layer, or `scheme` (a new
    plan's); Refused when the base plan does not resolve on the model."""
    from quantcore.schemes.presets import get_scheme

    if base is None:
        return get_scheme(scheme)
    resolved, problem = resolve(model, base.body)
    if resolved is None:
        raise Refused(problem or f"plan {base.name} does not resolve on {model.name}")
    return resolved[layer]


def get_plan(ref: int | str) -> PlanRecord:
    """A plan version by id or 'name' / 'name@vN'; store.repo.NotFound (a LookupError) otherwise."""
    with session_scope(settings()) as s:
        return repo.get_plan(s, ref)


def newest_plan(plans: list[PlanRecord]) -> PlanRecord | None:
    """The plan saved last (any name), which the Results and Kernels pages start on; None without plans."""
    return max(plans, key=lambda p: p.id, default=None)


_RESOLVED: OrderedDict[tuple, tuple[dict | None, str | None]] = OrderedDict()  # newest last


_RESOLVED_LOCK = threading.Lock()


_RESOLVED_KEEP = 32  # a page resolves the plan it shows a dozen times (table, checks, step bounds, cache)


def resolve(model: ModelRecord, body: dict[str, Any]) -> tuple[dict[str, Scheme] | None, str | None]:
    """(resolved {layer: Scheme}, None) or (None, the PlanError message). The last few answers are kept, keyed by
    the model (its row, checkpoint and layers) and the body's content: a page asks the same again and again."""
    import json

    key = (model.id, model.sha256, tuple(layer_names(model)), json.dumps(body, sort_keys=True, default=str))
    with _RESOLVED_LOCK:
        hit = _RESOLVED.get(key)
        if hit is not None:
            _RESOLVED.move_to_end(key)
    if hit is None:
        hit = _resolve(model, body)
        with _RESOLVED_LOCK:
            _RESOLVED[key] = hit
            while len(_RESOLVED) > _RESOLVED_KEEP:
                _RESOLVED.popitem(last=False)
    resolved, problem = hit
    return (dict(resolved) if resolved is not None else None), problem  # a copy: callers may change theirs


def _resolve(model: ModelRecord, body: dict[str, Any]) -> tuple[dict | None, str | None]:
    from quantcore.errors import PlanError
    from quantcore.planning.plans import PlanSpec, resolve_plan

    try:
        spec = PlanSpec.from_dict(body)
    except PlanError as exc:  # a bad serving field: what the layers' schemes would run into is said at once too
        rest = {k: v for k, v in body.items() if k not in SERVING_KEYS}
        try:
            rest_spec = PlanSpec.from_dict(rest)
        except PlanError:  # the file's trouble is elsewhere: said once
            return None, str(exc)
        try:
            resolve_plan(rest_spec, layer_names(model))
        except PlanError as more:
            return None, f"{exc}\n{more}"
        return None, str(exc)
    try:
        resolved = resolve_plan(spec, layer_names(model))
        kv_skipped(model, body)  # layer indices and sliding_window checked against this model
        return resolved, None
    except (PlanError, ValueError) as exc:
        return None, str(exc)


SERVING_KEYS = ("kv_cache", "kv_cache_skip", "tensor_parallel", "expert_parallel")  # a plan's fields beside schemes


def kv_skipped(model: ModelRecord, body: dict[str, Any]) -> set[str]:
    """The attention modules a plan keeps out of its quantized KV cache (``kv_cache_skip``, resolved by
    quantcore.evaluation.kvcache.kv_skip_layers against the model's layers and sliding windows); PlanError for entries
    the model does not have."""
    from quantcore.evaluation.kvcache import kv_layer_elements, kv_skip_layers
    from quantcore.planning.plans import PlanSpec

    spec = PlanSpec.from_dict(body)
    if spec.kv_cache == "AUTO" or not spec.kv_cache_skip:
        return set()
    return kv_skip_layers(spec.kv_cache_skip, kv_layer_elements(model.linears), model.attention_windows)


def resolved_or_raise(model: ModelRecord, body: dict[str, Any]) -> dict[str, Scheme]:
    """The resolved plan {layer: Scheme}; ValueError with the plan's problems when it does not resolve."""
    resolved, problem = resolve(model, body)
    if problem:
        raise Refused(problem)
    assert resolved is not None  # resolve answers a plan or a problem
    return resolved


def parallelism(model: ModelRecord, body: dict[str, Any]) -> Parallelism:
    """quantcore.models.parallel.Parallelism of a plan body on the model: its tensor_parallel and expert_parallel, with
    the model's attention heads (one GPU for a body that does not parse)."""
    from quantcore.errors import PlanError
    from quantcore.models.parallel import ONE_GPU
    from quantcore.planning.plans import PlanSpec

    try:
        spec = PlanSpec.from_dict(body)
    except PlanError:
        return ONE_GPU
    return spec.parallelism(attention_heads(model) if spec.tensor_parallel > 1 else None)


def plan_footprint(model: ModelRecord, body: dict[str, Any]) -> Footprint:
    """quantcore.planning.footprint.Footprint of a plan body on the model (linear weights, scales included);
    ValueError with the plan's problems when it does not resolve."""
    from quantcore.planning.footprint import plan_footprint as footprint

    return footprint(resolved_or_raise(model, body), layer_shapes(model))


def served_weight_bytes(model: ModelRecord, fp: Footprint, resolved: dict[str, Any]) -> tuple[float, float]:
    """(plan, all-BF16) bytes of every weight a server loads: the linear weights of the plan's Footprint
    ``fp`` as stored, every other parameter (embeddings, norms, biases) in BF16, and the input embedding again
    where the plan quantizes a head tied to it (``resolved``; quantcore.planning.serving.untied_embedding_bits)."""
    from quantcore.planning.serving import untied_embedding_bits

    other = max(0, model.num_params - fp.params) * 2
    untied = untied_embedding_bits(resolved, layer_shapes(model), model.tied_linears) / 8
    return fp.bits / 8 + other + untied, fp.bf16_bits / 8 + other


def bf16_body(body: dict[str, Any]) -> dict[str, Any]:
    """The all-BF16 plan a plan body is compared with: on the plan's GPUs (its tensor_parallel, expert_parallel)."""
    return {"default": "BF16", **{k: body[k] for k in ("tensor_parallel", "expert_parallel") if body.get(k)}}


def gpus_label(tensor_parallel: int, expert_parallel: bool = False) -> str:
    """"1 GPU", "3 GPUs", "2 GPUs, experts whole" (as :func:`quantcore.planning.plans.gpus_label` says a plan's)."""
    from quantcore.planning.plans import gpus_label as plan_gpus

    return plan_gpus({"tensor_parallel": tensor_parallel, "expert_parallel": expert_parallel})
