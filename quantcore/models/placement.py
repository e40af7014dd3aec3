"""Spreading one job's model over a worker's GPUs with accelerate (``device_map`` / ``max_memory``).

The model is built on the meta device from its config (``accelerate.init_empty_weights``: no weight is read) and
accelerate's ``infer_auto_device_map`` places its modules on the devices in order, never splitting a decoder block
(``no_split_module_classes``: the block class of :func:`quantcore.models.decoder.find_decoder_blocks`), so a block's
attention and MLP always run on one device and only the hidden states cross between devices. A worker uses the
placement where the model does not fit its job's one device but fits across all of its GPUs
(``quantplan worker --gpus 0,1,2,3`` or ``CUDA_VISIBLE_DEVICES``): transformers loads each weight straight onto its
device (``from_pretrained(device_map=...)``) and accelerate's hooks move the hidden states between them.

Where even every GPU together is too small, :func:`plan_placement` raises :class:`PlacementError` with the sizes;
the job then runs as it would on one device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantcore.errors import CheckpointError

GIB = 1024**3
RESERVE_FRACTION = 0.10  # of each GPU's free memory kept back for activations, the head's logits and CUDA's own


class PlacementError(CheckpointError):
    """The model does not fit across the devices given: names its size and what each device offers."""


@dataclass(frozen=True)
class Placement:
    """Where each module of a model goes: ``device_map`` as accelerate writes it (module name → device index),
    the decoder blocks' module names (``block_prefix.i``), and the model's bytes in the dtype placed."""

    device_map: dict[str, Any]
    block_prefix: str
    n_blocks: int
    model_bytes: int

    @property
    def devices(self) -> list[Any]:
        """The devices used, in the order the model runs through them."""
        return list(dict.fromkeys(self.device_map.values()))

    @property
    def split(self) -> bool:
        """More than one device holds a part of the model."""
        return len(self.devices) > 1

    def device_of(self, module: str) -> Any:
        """The device ``module`` (or the module that contains it) is placed on."""
        best = max((name for name in self.device_map if name == "" or module == name
                    or module.startswith(name + ".")), key=len, default=None)
        if best is None:
            raise KeyError(f"{module!r} is in no placed module")
        return self.device_map[best]

    def blocks_on(self) -> dict[Any, list[int]]:
        """{device: the decoder blocks on it}, in model order."""
        out: dict[Any, list[int]] = {}
        for i in range(self.n_blocks):
            out.setdefault(self.device_of(f"{self.block_prefix}.{i}"), []).append(i)
        return out


def empty_model(config: Any) -> Any:
    """The model of ``config`` on the meta device: its modules and parameter shapes, no memory, no weights read."""
    from accelerate import init_empty_weights

    from quantcore.models.loading import auto_class

    with init_empty_weights():
        return auto_class(config).from_config(config)


def model_bytes(model: Any, dtype: Any) -> int:
    """The bytes of ``model``'s parameters and buffers in ``dtype`` (integer buffers at their own size)."""
    import torch

    size = torch.tensor([], dtype=dtype).element_size()
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in tensors)


def plan_placement(config: Any, max_memory: Mapping[Any, int | str], *, dtype: Any = None) -> Placement:
    """Place the model of ``config`` over the devices of ``max_memory`` ({device index: bytes or "20GiB"}), in the
    order given, each decoder block whole on one device (accelerate's ``infer_auto_device_map``).
    PlacementError when it does not fit: what the model needs and what the devices offer."""
    import torch
    from accelerate import infer_auto_device_map
    from accelerate.utils import convert_file_size_to_int

    from quantcore.models.decoder import find_decoder_blocks

    if not max_memory:
        raise PlacementError("no device to place the model on: max_memory is empty")
    dtype = dtype or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = empty_model(config)
    stack = find_decoder_blocks(model)
    needed = model_bytes(model, dtype)
    budget = {k: convert_file_size_to_int(v) for k, v in max_memory.items()}
    device_map = infer_auto_device_map(model, max_memory=budget, dtype=dtype,
                                       no_split_module_classes=[type(stack.blocks[0]).__name__])
    off = sorted({str(d) for d in device_map.values() if d not in budget})
    if off:
        offered = ", ".join(f"device {k}: {v / GIB:.2f} GiB" for k, v in budget.items())
        raise PlacementError(f"{config.model_type} model of {needed / GIB:.2f} GiB in {dtype} does not fit across "
                             f"the devices ({offered}); accelerate would put a part of it on {', '.join(off)}")
    return Placement(device_map=dict(device_map), block_prefix=stack.prefix, n_blocks=len(stack.blocks),
                     model_bytes=needed)


def gpu_budget(reserve: float = RESERVE_FRACTION) -> dict[int, int]:
    """{CUDA device index: the bytes a model may take there}: each visible device's free memory less ``reserve``
    of it ({} without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    budget = {}
    for i in range(torch.cuda.device_count()):
        free, _total = torch.cuda.mem_get_info(i)
        budget[i] = int(free * (1.0 - reserve))
    return budget


def placement_for(folder: Path, device: str, *, dtype: Any = None,
                  budget: Mapping[int, int] | None = None) -> Placement | None:
    """The placement a job on ``device`` loads the checkpoint in ``folder`` with: None where the job's one device
    holds the model (or it is no CUDA job, or the worker has one GPU), else the model over every visible GPU from
    the job's on (PlacementError where even they are too small). ``budget``: {device: bytes} (default: free
    memory, :func:`gpu_budget`)."""
    import torch

    from quantcore.models.loading import load_config

    if not device.startswith("cuda"):
        return None
    budget = dict(gpu_budget() if budget is None else budget)
    first = int(device.partition(":")[2] or 0)
    budget = {i: b for i, b in budget.items() if i >= first}
    if len(budget) < 2:
        return None
    config = load_config(folder)
    dtype = dtype or getattr(config, "torch_dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if model_bytes(empty_model(config), dtype) <= budget[first]:
        return None  # one device: no hidden states cross between GPUs
    return plan_placement(config, budget, dtype=dtype)


__all__ = ["Placement", "PlacementError", "empty_model", "gpu_budget", "model_bytes", "placement_for",
           "plan_placement"]
