"""Serving checks of a resolved plan: what a serving engine (vLLM) or its kernels cannot run as planned.

Each check takes the resolved plan (``{layer: Scheme or preset name}``, :func:`quantcore.planning.plans.resolve_plan`)
and, where shapes matter, ``{layer: (N, K)}``, and says which layers a kernel's tiles or groups do not fit, which
schemes vLLM cannot load, or which a fused MoE kernel cannot run; the app and the CLI show them as warnings, and the
automatic planner never picks what they refuse. torch-free, like :mod:`quantcore.planning.plans`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from quantcore.formats.granularity import Granularity
from quantcore.models.architectures import LLAMA_STYLE
from quantcore.models.parallel import ONE_GPU, Parallelism, partition
from quantcore.models.parallel import ROW as TP_ROW
from quantcore.planning.plans import example_names, group_label, scheme_label
from quantcore.schemes.fusion import expert_block, expert_blocks, fusion_units
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import IDENTITY_BITS, Scheme


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
    (:mod:`quantcore.models.parallel`), and a group of weights must not straddle two GPUs: vLLM refuses a shard that is
    not a whole number of groups (``verify_group_size_divides_partition``: "This happens when tensor_parallel_size
    splits the layer input into shards that are not a whole number of quant groups"). Those layers get a message of
    their own, per (scheme, group). (FP8_BLOCK's shards are :func:`fp8_block_misfits`'.)
    """
    tp = parallel.tp
    misfit = _group_misfit_entries(resolved, shapes, parallel)
    out = []
    for (label, g, shard), e in misfit.items():
        kset = set(e["layers"].values())
        ks = ", ".join(map(str, sorted(kset)))
        if shard:
            out.append(f"{label} at tensor_parallel {tp}: each GPU holds K / {tp} = {ks} inputs of "
                       f"{len(e['layers'])} row-parallel layer(s) (e.g. {next(iter(e['layers']))}), not a whole number "
                       f"of groups of {g}: vLLM "
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
    w = scheme.weights
    if w is not None and w.granularity is Granularity.GROUP:
        return f"whose groups of {w.group_size} divide them"
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
    same = [  # (preset, its weights)
        (other, ow) for other in map(get_scheme, list_schemes())
        if (ow := other.weights) is not None and ow.granularity in (Granularity.GROUP, Granularity.CHANNEL)
        and (ow.format, ow.symmetric, other.activations, other.gptq, other.awq, other.smoothquant_alpha)
        == (w.format, w.symmetric, scheme.activations, scheme.gptq, scheme.awq, scheme.smoothquant_alpha)
    ]
    fits = [(o, g) for o, ow in same if ow.granularity is Granularity.GROUP and (g := ow.group_size) is not None
            and g != w.group_size and all(k % g == 0 for k in ks)]
    if fits:
        return max(fits, key=lambda fit: fit[1])[0]
    return next((o for o, ow in same if ow.granularity is Granularity.CHANNEL and o is not scheme), None)


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
        out.append(f"FP8 blocks of {cols[0][2]} columns do not divide K{at} of {len(cols)} row-parallel layer(s) "
                   f"(K = {ks}, e.g. {cols[0][0]}): vLLM's validate_fp8_block_shape refuses them "
                   "(\"input_size_per_partition ... is not divisible by weight quantization block_k\"), so the "
                   "checkpoint does not load: keep those layers in another scheme or choose a smaller tensor_parallel")
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
        assert w.block is not None  # a block-granular spec has its block
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


# the linears AWQ can fold its factors for (quantcore.algorithms.awq: awq_mappings), by the architecture registry's
# names (the plan's layer names carry no model type; every registered architecture names these leaves alike)
AWQ_FOLDABLE = LLAMA_STYLE.fold_leaves


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
        v = shapes.get(f"{head}.{LLAMA_STYLE.v_proj}")
        if leaf not in AWQ_FOLDABLE or (leaf == LLAMA_STYLE.o_proj and (v is None or v[0] != shapes[layer][1])):
            lost.append(layer)
    if not lost:
        return []
    return [f"AWQ cannot scale {len(lost)} layer(s) ({example_names(lost)}): nothing before them takes the "
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

    One method per block also means one scheme for all of a block's experts: a per-expert plan (``per_expert:
    true``) whose experts of one block differ is refused here too, naming the block and which experts take what
    (:func:`mixed_expert_blocks`).
    """
    unserved: dict[str, list[str]] = {}
    for block, members in _unserved_expert_blocks(resolved).items():
        labels = dict.fromkeys(scheme_label(get_scheme(resolved[m])) for m in members if _unserved(resolved[m]))
        for label in labels:
            unserved.setdefault(label, []).append(block)
    out = [f"vLLM's fused MoE layer has no kernel for {label} experts ({example_names(blocks)}): loading the "
           "checkpoint fails with \"Unsupported FusedMoe scheme\". It serves experts in weight-only int "
           "(W4A16, W8A16), MXFP4, NVFP4, FP8 W8A8 and INT8 W8A8 with per-token activations; give those blocks "
           "one of them" for label, blocks in unserved.items()]
    mixed = mixed_expert_blocks(resolved)
    if mixed:
        parts = "; ".join(f"{block}: {expert_mix(by)}" for block, by in list(mixed.items())[:3])
        more = f" and {len(mixed) - 3} more block(s)" if len(mixed) > 3 else ""
        out.append(f"vLLM's fused MoE layer runs every expert of a block with one quantization method, but "
                   f"{len(mixed)} MoE block(s) of this per-expert plan give their experts different schemes "
                   f"({parts}{more}): vLLM cannot serve it; the llm-compressor recipe and its compressed-tensors "
                   "checkpoint hold it (for another engine, or to compare), or give each block's experts one scheme")
    return out


def mixed_expert_blocks(resolved: Mapping[str, Scheme | str]) -> dict[str, dict[str, list[int]]]:
    """{MoE block: {scheme label: its expert indices}} of the blocks whose routed experts take more than one scheme
    (a per-expert plan), in model order."""
    out: dict[str, dict[str, list[int]]] = {}
    for block, members in expert_blocks(resolved).items():
        by: dict[str, list[int]] = {}
        for m in members:
            e = int(m[len(block) + 1:].split(".", 1)[0])
            experts = by.setdefault(scheme_label(get_scheme(resolved[m])), [])
            if e not in experts:
                experts.append(e)
        if len(by) > 1:
            out[block] = by
    return out


def expert_mix(by: Mapping[str, list[int]]) -> str:
    """"W4A16 on experts 0-2, 5; FP8_DYNAMIC on 3, 4": which experts take which scheme."""
    return "; ".join(f"{label} on expert(s) {_ranges(sorted(experts))}" for label, experts in by.items())


def _ranges(values: list[int]) -> str:
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _unserved_expert_blocks(resolved: Mapping[str, Scheme | str]) -> dict[str, list[str]]:
    """{MoE block: its expert linears} of the blocks where some expert's scheme is one vLLM's fused MoE has no
    method for."""
    return {block: list(members) for block, members in expert_blocks(resolved).items()
            if any(_unserved(resolved[m]) for m in members)}


def _unserved(scheme: Scheme | str) -> bool:
    """A scheme vLLM's fused MoE has no method for (INT8 without per-token activations, MXFP8)."""
    s = get_scheme(scheme)
    w, a = s.weights, s.activations
    if w is None or a is None:
        return False
    return (w.format == "int8" and not (a.granularity is Granularity.TOKEN and a.dynamic)) or w.format == "mxfp8"


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
    for (INT8 without per-token activations, MXFP8: :func:`moe_unserved`) or whose experts mix schemes (a per-expert
    plan: :func:`mixed_expert_blocks`)."""
    experts = [m for members in _unserved_expert_blocks(resolved).values() for m in members]
    experts += [m for block in mixed_expert_blocks(resolved) for m in expert_blocks(resolved)[block]
                if m not in set(experts)]
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
        out.append(f"INT8 with dynamic per-tensor activations on {len(int8)} layer(s) ({example_names(int8)}): vLLM's "
                   "compressed-tensors loader has no kernel for it (\"No compressed-tensors compatible scheme was "
                   "found\"); its INT8 W8A8 takes calibrated per-tensor or dynamic per-token activation scales "
                   "(INT8_W8A8, INT8_W8A8_SQ), so the checkpoint does not load")
    if fp8:
        out.append(f"FP8 with dynamic per-tensor activations on {len(fp8)} layer(s) ({example_names(fp8)}), in a "
                   "checkpoint: vLLM quantizes dynamic FP8 activations per token there, which is better than this "
                   "score measured (per tensor); only its online --quantization fp8, for a plan that is "
                   "FP8_PER_TENSOR throughout, quantizes them per tensor")
    return out
