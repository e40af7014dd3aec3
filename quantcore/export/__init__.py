"""Export a resolved plan to serving tools, and import it back (torch-free).

One module per target: :mod:`~quantcore.export.llmcompressor` (recipes), :mod:`~quantcore.export.compressed_tensors`
(the checkpoint's ``quantization_config``), :mod:`~quantcore.export.vllm` (the serving command), on top of
:mod:`~quantcore.export.quant_args` (compressed-tensors' quantization args and presets) and
:mod:`~quantcore.export.common` (grouping a plan, assigning imported groups to layers).

Three targets, all describing the same thing — which quantization every linear layer gets:

- an **llm-compressor recipe** (YAML): a ``QuantizationModifier`` with a preset ``scheme``
  or explicit ``config_groups``, ``targets`` and an ``ignore`` list, preceded by one
  ``SmoothQuantModifier`` per SmoothQuant strength the plan uses;
- a **compressed-tensors** ``quantization_config`` (the JSON that llm-compressor writes into
  a compressed checkpoint's ``config.json`` and vLLM reads);
- the matching **vLLM** ``serve`` command line.

and the plan's KV cache format (:mod:`quantcore.evaluation.kvcache`): ``FP8`` and ``FP8_ATTN`` are a
``kv_cache_scheme`` (static per-tensor E4M3, calibrated, so the recipe needs calibration data; vLLM
reads the ``k_scale`` / ``v_scale`` it writes) plus ``--kv-cache-dtype fp8``, ``FP8_ATTN_HEAD`` the
same with ``strategy: attn_head`` (a scale per KV head, read by vLLM's FlashAttention backend only); ``FP8_UNSCALED``,
``FP8_ATTN_UNSCALED`` and ``FP8_E5M2`` are the vLLM flag alone (``fp8`` / ``fp8_e5m2``, scale 1.0).
Whether attention itself runs in FP8 (the ``FP8_ATTN`` formats) is vLLM's attention backend, not
the checkpoint: the vLLM command says which backend computes what the score emulated.

quantplan writes no attention config group (llm-compressor's way to calibrate a ``q_scale``):
with llmcompressor 0.14.0.1 its calibration context forces eager attention (``use_eager_attention``)
over compressed-tensors' hooked attention, so the query observer never runs and ``q_scale`` is saved
uninitialized (seen here on a tiny Llama: 0, 1.4e-19, 59711.6, with the warning "Attempted to
calibrate a module q without statistics"). Without a ``q_scale`` vLLM runs Q at 1.0, which is what
``FP8_ATTN`` emulates.

Facts these modules rely on (compressed-tensors 0.19.0 / llmcompressor 0.14.0.1, read in
their sources, and vLLM's compressed-tensors loader):

- ``QuantizationArgs``: ``num_bits``, ``type`` ("int" | "float"), ``strategy`` ("tensor",
  "channel", "token", "group", "block", "tensor_group"), ``symmetric``, ``dynamic`` (bool,
  or "local" = block scales dynamic, global scale calibrated; NVFP4 activations),
  ``group_size``, ``block_structure`` ([rows, cols]), ``scale_dtype``. A float with
  ``num_bits: 8`` is always E4M3 (``FP8_E4M3_DATA``): **E5M2 cannot be expressed**.
  4-bit floats exist only block-scaled: NVFP4 (``tensor_group``, 16, E4M3 scales) and
  MXFP4 (``group``, 32, ``scale_dtype: torch.uint8`` = E8M0). MXFP8 is 8-bit float,
  ``group`` 32, ``torch.uint8`` scales. Activations cannot use ``block``.
- Preset names (``PRESET_SCHEMES``) and what they mean are in :data:`CT_PRESETS`. Two
  look alike but differ: compressed-tensors' ``W8A16`` is INT8 weights in *groups of
  128*, quantplan's ``W8A16`` is INT8 *per channel*; presets are therefore matched by
  their arguments, never by name.
- Target matching (``compressed_tensors.utils.match``): a target is an exact module
  name, a ``re:`` regular expression applied with ``re.match`` (anchored at the start
  only), or a class name such as ``Linear``. A module matched by several targets takes
  the first of: exact names, then regexes (sorted as strings), then class names.
- vLLM looks up a fused layer (``qkv_proj``, ``gate_up_proj``) by *class name before its
  shards' names*, so a plan with several config groups never uses the class target
  ``Linear`` (it would capture every fused layer); such plans target layers by name.

Layer names
    ``layer_names`` must be every ``nn.Linear`` of the model, ``lm_head`` included (the
    list :mod:`quantcore.evaluation.calibrate` and the sensitivity sweep use): a single-scheme
    export targets the class ``Linear`` and relies on ``ignore`` for the BF16 layers.

Import (``from_llmcompressor_recipe``, ``from_compressed_tensors_config``) gives each
layer the quantplan preset whose weight and activation specs match its config group,
with the SmoothQuant strength of the mapping that covers it. A smoothed layer gets the
``*_SQ`` preset when one exists (``INT8_W8A8_SQ``; alpha kept when it differs from 0.5),
otherwise its base preset with the alpha. Hence ``export → import`` returns the same
plan for every plan of presets (``INT8_W8A8`` given an alpha comes back as
``INT8_W8A8_SQ`` with that alpha: the same numerics under its canonical name).
"""

