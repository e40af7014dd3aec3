"""Export of plans to serving tools (llm-compressor, compressed-tensors, vLLM) and import of plan files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from quantplan.services.models import layer_names
from quantplan.services.plans import kv_skipped, resolve, save_plan, unchanged_version
from store.records import ModelRecord, PlanRecord

EXPORT_FORMATS = ("llmcompressor", "compressed-tensors", "vllm")


def _mlp_norm(model: ModelRecord) -> str:
    """The norm in front of the MLP, from the architecture registry: Gemma 2 / 3 have a pre-feedforward norm,
    Llama-style models (Gemma 1 included) reuse post_attention_layernorm; the name alone cannot tell them apart."""
    from quantcore.models.architectures import get_architecture

    return get_architecture(model.model_type).mlp_norm


def export_plan(model: ModelRecord, body: dict[str, Any], fmt: str, recipe_file: str | None = None,
                plan: PlanRecord | None = None) -> str:
    """The plan as an llm-compressor recipe (YAML), a compressed-tensors quantization_config (JSON)
    or the vLLM command line (its compression step reading the recipe from ``recipe_file``, "recipe.yaml" unless
    given: the name the recipe is saved under). ``plan``: the stored version ``body`` is; where it is the version
    chosen for its model, the recipe and the command start with a comment saying who chose it, when and why
    (quantplan.services.choices; a JSON config has no comments and stays as compressed-tensors reads it)."""
    text = _export(model, body, fmt, recipe_file)
    if plan is not None and fmt in ("llmcompressor", "vllm"):
        from quantplan.services.choices import chosen_comment

        return chosen_comment(plan) + text
    return text


def _export(model: ModelRecord, body: dict[str, Any], fmt: str, recipe_file: str | None) -> str:
    import json

    from quantcore.errors import PlanError
    from quantcore.export import compressed_tensors, llmcompressor, vllm
    from quantcore.planning.plans import PlanSpec

    resolved, problem = resolve(model, body)
    if problem:
        raise PlanError(problem)
    assert resolved is not None  # resolve answers a plan or a problem
    spec = PlanSpec.from_dict(body)
    kv = spec.kv_cache
    names = layer_names(model)
    if fmt == "llmcompressor":
        return llmcompressor.to_llmcompressor_recipe(resolved, layer_names=names, mlp_norm=_mlp_norm(model),
                                                     kv_cache=kv, rotation=spec.rotation,
                                                     rotation_widths=_rotation_widths(model, spec))
    if fmt == "compressed-tensors" and spec.rotation is not None:
        raise PlanError(f"this plan rotates the model ({spec.rotation.label()}): a compressed-tensors "
                        "quantization_config cannot carry the rotation; export the llmcompressor recipe "
                        "(SpinQuantModifier), which rotates the weights and writes the transform config itself")
    if fmt == "compressed-tensors":
        return json.dumps(compressed_tensors.to_compressed_tensors_config(resolved, layer_names=names, kv_cache=kv),
                          indent=2) + "\n"
    if fmt == "vllm":
        # the folder quantplan stored is a loadable HF checkpoint (a GGUF or an archive upload is not)
        folder = Path(str(settings().artifact_dir)) / model.path
        return (f"# {model.name}: {folder} holds the checkpoint quantplan analysed (safetensors + tokenizer, "
                f"from {model.source_name}); use your own copy or hub id where you serve from elsewhere\n"
                + vllm.to_vllm_command(resolved, model_path=str(folder), layer_names=names,
                                         compressed_path=_safe_name(model.name) + vllm.COMPRESSED_SUFFIX,
                                         kv_cache=kv, kv_skip=spec.kv_cache_skip,
                                         tensor_parallel=spec.tensor_parallel,
                                         expert_parallel=spec.expert_parallel,
                                         recipe_path=recipe_file or vllm.DEFAULT_RECIPE_FILE))
    raise Refused(f"unknown export format {fmt!r}; valid: {', '.join(EXPORT_FORMATS)}")


def _rotation_widths(model: ModelRecord, spec: Any) -> Any:
    """The widths a plan's rotation acts on (quantcore.export.spinquant.widths_from_linears), None without one."""
    if spec.rotation is None:
        return None
    from quantcore.export.spinquant import widths_from_linears
    from quantplan.services.models import attention_heads

    heads = attention_heads(model)
    return widths_from_linears(model.linears, heads.head_dim if heads is not None else None)


def _safe_name(name: str) -> str:
    """A model name as a relative folder name: letters, digits, '.', '_' and '-' only."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-") or "model"


CONFIG_IMPORT_NOTE = ("a compressed-tensors config holds the formats only: SmoothQuant's α and GPTQ / AWQ rounding "
                      "are steps of the recipe that made the checkpoint, not in its config, so the plan has none of "
                      "them (import the llm-compressor recipe to keep them)")


def import_note(filename: str) -> str | None:
    """What an import of ``filename`` cannot carry over, to say beside it: :data:`CONFIG_IMPORT_NOTE` for a
    compressed-tensors config (.json), None for a plan or a recipe (YAML), which keep everything."""
    return CONFIG_IMPORT_NOTE if filename.lower().endswith(".json") else None


def import_plan(model: ModelRecord, filename: str, text: str | bytes,
                name: str | None = None) -> tuple[PlanRecord, bool]:
    """Import a plan file (YAML, quantplan's format), an llm-compressor recipe (YAML) or a compressed-tensors
    quantization_config / config.json (JSON) as a new plan version of `model`: (the version, True); (the newest
    version of that name, False) when it holds the same plan already. The text (or the uploaded bytes) is read
    with quantcore's bounded loader: a file too large, binary, with YAML aliases or nested too deeply is Refused
    with a sentence naming it."""
    from quantcore.export import compressed_tensors, llmcompressor
    from quantcore.planning.plans import PlanSpec, resolve_plan, spec_from_plan
    from quantcore.safeload import MAX_PLAN_BYTES, load_json, load_yaml, short_name

    names = layer_names(model)
    stem = Path(filename).stem
    source = short_name(Path(filename).name)
    if filename.lower().endswith(".json"):
        cfg = load_json(text, source, Refused, max_bytes=MAX_PLAN_BYTES)
        plan = compressed_tensors.from_compressed_tensors_config(cfg, layer_names=names)
        spec = spec_from_plan(plan, model=model.name)
        spec.kv_cache = compressed_tensors.kv_cache_of_config(cfg)
    else:
        data = load_yaml(text, source, Refused)
        if not isinstance(data, dict):
            raise Refused(f"{source}: expected a YAML mapping (a quantplan plan or an llm-compressor recipe)")
        if {"default", "rules", "layers"} & set(data):
            spec = PlanSpec.from_dict(data)
            resolve_plan(spec, names)  # refuse what does not fit this model, with the reasons
            kv_skipped(model, spec.to_dict())  # its kv_cache_skip too
        else:
            spec = spec_from_plan(llmcompressor.from_llmcompressor_recipe(text, layer_names=names, source=source),
                                  model=model.name)
            spec.kv_cache = llmcompressor.kv_cache_of_recipe(text)
    plan_name = name or spec.name or stem
    spec.name, spec.model = plan_name, model.name
    if same := unchanged_version(model.id, plan_name, spec.to_dict()):  # imported twice: no second, equal version
        return same, False
    return save_plan(model.id, plan_name, spec.to_dict(), note=f"imported from {Path(filename).name[:200]}"), True
