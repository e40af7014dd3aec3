"""Every weight present, none unused: the checkpoint's tensors must be exactly the parameters its architecture needs.

transformers fills a parameter missing from the files with random values (printing "MISSING" on stderr) and drops a
tensor it has no place for, so a checkpoint holding only a tensor named ``foo`` beside a valid config would load as
a model of random weights and calibrate "successfully". quantplan refuses such a checkpoint instead, naming the
first few names:

- at registration, from the safetensors headers alone: the model is built on the meta device with
  ``from_pretrained(device_map="meta")`` (no weight is read; transformers' own name conversions, tied embeddings and
  ignore lists apply) and its loading report is checked (:func:`meta_model_checked`);
- at load time, the same report of the real load (:func:`refuse_incomplete`).

Names transformers documents as ignorable (its ``_keys_to_ignore_on_load_*`` lists) and rotary ``inv_freq`` caches
that old checkpoints carry (:data:`IGNORABLE`) are not "unused". Importing this module never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantcore.errors import CheckpointError, name_list
from quantcore.models.validation import CONFIG_FILE

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PretrainedConfig, PreTrainedModel

# tensors a checkpoint may carry that no parameter takes: rotary-embedding caches (old Llama / GPT-NeoX exports),
# attention bias masks of GPT-2-style models; transformers recomputes them
IGNORABLE = (r"(^|\.)rotary_emb\.inv_freq$", r"(^|\.)attn\.(masked_)?bias$", r"(^|\.)inv_freq$")
SHOWN = 5  # names listed in a refusal


def _ignorable(name: str) -> bool:
    return any(re.search(pattern, name) for pattern in IGNORABLE)


def refuse_incomplete(info: Mapping[str, Any]) -> None:
    """Raise CheckpointError when a transformers loading report (``output_loading_info=True``) has missing,
    unexpected (not :data:`IGNORABLE`) or mismatched weights, naming the first :data:`SHOWN` of each."""
    missing = sorted(str(n) for n in info.get("missing_keys") or ())
    unused = sorted(str(n) for n in info.get("unexpected_keys") or () if not _ignorable(str(n)))
    mismatched = [str(m[0]) if isinstance(m, (tuple, list)) else str(m) for m in info.get("mismatched_keys") or ()]
    problems = []
    if missing:
        problems.append(f"{len(missing)} weight(s) the architecture needs are not in the files "
                        f"({name_list(missing, SHOWN)})")
    if unused:
        problems.append(f"{len(unused)} tensor(s) in the files are used by no parameter ({name_list(unused, SHOWN)})")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) have another shape than {CONFIG_FILE} implies "
                        f"({name_list(mismatched, SHOWN)}): the configuration and the weights come from different "
                        "models")
    if problems:
        raise CheckpointError(f"the safetensors weights do not match {CONFIG_FILE}: " + "; ".join(problems)
                              + ". quantplan never fills a weight at random: upload the complete folder "
                              "save_pretrained wrote")


def meta_model_checked(folder: Path, config: PretrainedConfig, model_class: Any) -> PreTrainedModel:
    """The model of ``folder`` on the meta device, its names and shapes checked against the safetensors headers
    (no weight data is read); CheckpointError when a weight is missing, unused or of another shape."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = model_class.from_pretrained(
                folder, config=config, device_map="meta", dtype=torch.float32, use_safetensors=True,
                output_loading_info=True, ignore_mismatched_sizes=True, local_files_only=True,
                trust_remote_code=False)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, OSError) as exc:
        text = " ".join(str(exc).split())
        raise CheckpointError(f"transformers cannot build a {config.model_type} model from {CONFIG_FILE} and the "
                              f"weights' headers ({type(exc).__name__}: {text[:300]}); check that the "
                              "configuration and the weights belong together") from exc
    refuse_incomplete(info)
    return model

