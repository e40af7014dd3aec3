"""Block-streamed execution: a causal LM built on the meta device and run one decoder block at a time.

A checkpoint larger than a worker's memory still calibrates and scores: the model is built from its config with
accelerate's ``init_empty_weights`` (parameters on ``meta``, buffers such as rotary tables real), the weights outside
the decoder blocks (embedding, final norm, head: the *resident* part) are read once, and then for each decoder block
in turn its weights are read from the stored safetensors tensor by tensor (``safetensors.safe_open``), placed on the
job's device in the job's dtype, every sequence goes through it in batches, and the block goes back to ``meta``.

How a block runs exactly as in the model's own forward
    The sensitivity sweep's block-boundary mechanism (:mod:`quantcore.evaluation.sensitivity`): for block ``i`` the
    model's own ``forward`` runs with blocks ``0..i-1`` *replayed* (they return the kept hidden states without
    computing anything) and a forward hook on block ``i`` that stops the pass once the block has run. The model's
    forward therefore builds the attention masks, position ids and rotary tables per layer as it always does
    (Gemma 3's sliding-window and global layers get their own), with no architecture-specific code, and block ``i``
    sees bit for bit what it sees in a whole-model pass of the same batch. After the last block every block is
    replayed with the final hidden states (:meth:`StreamedModel.final`), so the existing whole-model code (the
    chunked head of :func:`quantcore.evaluation.batches.iter_logits`, the reference, the scorer, calibration hooks on
    the head) runs unchanged on top.

Where the hidden states live
    Two ``[S, L, H]`` tensors in the job's dtype (the current block's inputs and its outputs): on the job's device
    when they fit the budget beside the resident part and one block, else in host memory, else in a memory-mapped
    file in the job's scratch folder (removed when the run ends).

Supported: what the sensitivity sweep supports (:func:`quantcore.models.decoder.find_decoder_blocks`), with the
checkpoint's tensors under the parameters' own names (Llama, Mistral, Qwen2/3, Gemma/2/3 text), and MoE models whose
experts :func:`quantcore.models.moe.split_experts` splits (split on ``meta``, each expert's tensors read under the
checkpoint's names: :func:`quantcore.models.moe.checkpoint_name`). Anything else is refused with a
:class:`~quantcore.errors.CheckpointError` naming what was looked for.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from quantcore.errors import Cancelled, CheckpointError, PlanError, name_list
from quantcore.models.decoder import DecoderStack, find_decoder_blocks
from quantcore.models.loading import _resolve_dtype, auto_class, load_config
from quantcore.models.moe import checkpoint_name, split_experts
from quantcore.models.validation import SAFETENSORS_INDEX_SUFFIX

log = logging.getLogger(__name__)

GIB = 1 << 30
# what a job keeps besides the weights when deciding whole vs streamed: activations, the logits' chunks, torch's
# allocator slack; the whole model must fit in the budget less this share
WORKING_SHARE = 0.25

Progress = Callable[[float, str], None]
ShouldCancel = Callable[[], bool]
BlockContext = Callable[[int], AbstractContextManager[Any]]
# on a StreamedModel's ``model``: its :meth:`StreamedModel.transform_blocks` (a weak reference), for code that is given
# the model alone (quantcore.algorithms.rotation.rotate_model, which names it too: it cannot import this module)
TRANSFORM_BLOCKS = "quantplan_transform_blocks"


class _Stop(Exception):  # noqa: N818 - control flow, never seen outside this module
    """Raised by the hook on the block being run: the rest of the model's forward is not needed."""

    def __init__(self, output: Any) -> None:
        super().__init__("stop")
        self.output = output


# ---------------------------------------------------------------------- the budget


def available_memory(device: str | torch.device) -> int:
    """Bytes a job may fill on ``device``: free GPU memory on CUDA, available host memory (``MemAvailable``) on CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def memory_budget(device: str | torch.device, setting_gib: float | None = None) -> int:
    """The bytes a job's model may take: ``setting_gib`` (``QUANTPLAN_MODEL_MEMORY_GIB``) where set, else what the
    device has free (:func:`available_memory`)."""
    if setting_gib is not None and setting_gib > 0:
        return int(setting_gib * GIB)
    return available_memory(device)


def gib(n: int | float) -> str:
    return f"{n / GIB:.3g} GiB"


# ---------------------------------------------------------------------- the checkpoint's tensors


def _tensor_files(folder: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of a stored checkpoint: from its ``*.safetensors.index.json`` where it has
    one, else from the headers of its ``*.safetensors`` files."""
    from safetensors import safe_open

    indexes = sorted(folder.glob(f"*{SAFETENSORS_INDEX_SUFFIX}"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{indexes[0].name} is not a safetensors index with a weight_map: {exc}") from exc
        return {str(k): folder / str(v) for k, v in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {folder.name}: streamed execution reads safetensors "
                              "(a GGUF upload is converted to safetensors at registration)")
    names: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names.update((k, path) for k in f.keys())  # noqa: SIM118 - safe_open has keys(), not iteration
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{path.name} cannot be read as safetensors: {exc}") from exc
    return names


class TensorReader:
    """Reads named tensors from a checkpoint's safetensors files, one tensor at a time; a file missing or
    truncated is a CheckpointError naming the file and the tensor."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = _tensor_files(folder)
        self._open: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, *, where: str) -> Tensor:
        from safetensors import safe_open

        path = self.files[name]
        try:
            handle = self._open.get(path)
            if handle is None:
                handle = self._open[path] = safe_open(str(path), framework="pt")
            return handle.get_tensor(name)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{where}: weight file {path.name} is missing (it should hold {name})") from exc
        except Exception as exc:  # SafetensorError for a truncated or damaged file
            raise CheckpointError(f"{where}: cannot read {name} from {path.name} ({type(exc).__name__}: "
                                  f"{' '.join(str(exc).split())[:200]}); the file is truncated or damaged") from exc

    def close(self) -> None:
        self._open.clear()


# ---------------------------------------------------------------------- hidden states between blocks


class HiddenStates:
    """``[S, L, H]`` hidden states of every sequence at one block boundary, on the device, in host memory, or in a
    memory-mapped file (``path``) in a scratch folder."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, where: str, path: Path | None = None) -> None:
        self.where, self.path = where, path
        if path is not None:
            count = 1
            for n in shape:
                count *= int(n)
            self.data = torch.from_file(str(path), shared=True, size=count, dtype=dtype).view(*shape)
        else:
            self.data = torch.empty(tuple(shape), dtype=dtype, device=where)


@dataclass
class StreamPlan:
    """How a streamed run keeps its hidden states: ``where`` (a device, ``cpu``, or ``file``) and their bytes."""

    where: str
    state_bytes: int


# ---------------------------------------------------------------------- the streamed model


class StreamedModel:
    """A stored checkpoint built on the meta device and run one decoder block at a time (module docstring).

    ``model`` is the transformers model (its blocks on ``meta`` except the one running); ``stack`` its decoder blocks.
    Use :meth:`run` to push every sequence through the blocks (with a context per block: a plan applied to the block's
    linears, calibration hooks), then :meth:`final` to run the head (and anything else that needs the whole model's
    output) on the final hidden states.
    """

    def __init__(self, folder: str | Path, *, device: str = "cpu", dtype: torch.dtype | str | None = None,
                 budget: int | None = None, scratch: str | Path | None = None) -> None:
        from accelerate import init_empty_weights

        self.folder = Path(folder)  # validated at registration; a file lost since fails at the block that reads it
        self.device = torch.device(device)
        config = load_config(self.folder)
        resolved = _resolve_dtype(dtype, device)
        if resolved == "auto":
            resolved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
            if isinstance(resolved, str):
                resolved = getattr(torch, resolved)
        self.dtype: torch.dtype = resolved
        try:
            with init_empty_weights():
                self.model = auto_class(config).from_config(config, dtype=self.dtype)
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"transformers cannot build a {config.model_type} model from config.json "
                                  f"({type(exc).__name__}: {exc})") from exc
        # MoE: the experts split on meta as the whole-model load splits them (quantcore.models.moe), so each block
        # reads one tensor per expert and projection, under the names the checkpoint stores them by
        split_experts(self.model)
        self.model.eval().requires_grad_(False)
        self.model.__dict__[TRANSFORM_BLOCKS] = weakref.WeakMethod(self.transform_blocks)
        self._transform: BlockContext | None = None  # transform_blocks
        self._entered: dict[int, ExitStack] = {}
        self.config = config
        self._tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
        if self._tied:  # the head shares the embedding's tensor: read once, under the embedding's name
            self.model.tie_weights()
        self.stack: DecoderStack = find_decoder_blocks(self.model)
        # the stored tensors' names and sizes, once: the structure they come from does not change, and walking the
        # modules for them on every load and free cost more than reading a small block
        self._names = [n for _m, n in self._named()]
        params = dict(self.model.named_parameters())
        self._numel = {n: (params[n] if n in params else self.model.get_buffer(n)).numel() for n in self._names}
        self._working_rss: int | None = None  # resident bytes after the first block freed since a trim (_maybe_trim)
        self._slack: int | None = None
        self.reader = TensorReader(self.folder)
        self.budget = budget
        self._scratch_root = Path(scratch) if scratch is not None else None
        self._scratch: Path | None = None
        self._check_names()
        self._load_resident()
        self._check_budget()

    # -- structure

    def _block_prefix(self, i: int) -> str:
        return f"{self.stack.prefix}.{i}."

    def _named(self) -> list[tuple[str, str]]:
        """(module path, tensor attribute name) of every parameter and persistent buffer, tied ones once."""
        out = []
        for name, _p in self.model.named_parameters():
            out.append(name)
        for mname, module in self.model.named_modules():
            for bname, _b in module.named_buffers(recurse=False):
                if bname not in module._non_persistent_buffers_set:
                    out.append(f"{mname}.{bname}" if mname else bname)
        return [(n.rpartition(".")[0], n) for n in out]

    def block_tensors(self, i: int) -> list[str]:
        prefix = self._block_prefix(i)
        return [n for n in self._names if n.startswith(prefix)]

    def resident_tensors(self) -> list[str]:
        head = self.stack.prefix + "."
        return [n for n in self._names if not n.startswith(head)]

    def block_names(self, i: int) -> list[str]:
        """Names of the linear layers of block ``i``."""
        prefix = self._block_prefix(i)
        return [n for n, m in self.model.named_modules() if isinstance(m, nn.Linear) and n.startswith(prefix)]

    def resident_linears(self) -> list[str]:
        head = self.stack.prefix + "."
        return [n for n, m in self.model.named_modules() if isinstance(m, nn.Linear) and not n.startswith(head)]

    def _shape_bytes(self, names: Sequence[str]) -> int:
        size = torch.finfo(self.dtype).bits // 8
        return sum(self._numel[n] * size for n in names)

    def block_bytes(self, i: int) -> int:
        return self._shape_bytes(self.block_tensors(i))

    def resident_bytes(self) -> int:
        return self._shape_bytes(self.resident_tensors())

    def model_bytes(self) -> int:
        return self.resident_bytes() + sum(self.block_bytes(i) for i in range(len(self.stack.blocks)))

    def _check_names(self) -> None:
        # a split expert's tensor stored under its checkpoint's own name (Mixtral's block_sparse_moe.experts.N.w1)
        self._stored = {n: stored for _m, n in self._named() if n not in self.reader
                        and (stored := checkpoint_name(self.config.model_type, n)) in self.reader}
        missing = [n for _m, n in self._named() if n not in self.reader and n not in self._stored]
        if missing:
            raise CheckpointError(
                f"streamed execution reads every weight under its parameter's name, and {len(missing)} are not in "
                f"the safetensors files of {self.folder.name} ({name_list(missing, 5)}; looked in "
                f"{name_list(sorted({p.name for p in self.reader.files.values()}), 3)}); this checkpoint's layout "
                "is not supported streamed: run the job whole-model (--no-stream)")

    def _check_budget(self) -> None:
        if self.budget is None:
            return
        resident = self.resident_bytes()
        for i in range(len(self.stack.blocks)):
            need = self.block_bytes(i)
            if resident + need > self.budget:
                raise PlanError(
                    f"block {i} ({self.stack.prefix}.{i}) needs {gib(need)} in {str(self.dtype).removeprefix('torch.')}"
                    f" beside the embedding and head's {gib(resident)}: more than the budget of {gib(self.budget)} "
                    "(QUANTPLAN_MODEL_MEMORY_GIB, or the device's free memory). Give the job more memory: a larger "
                    "QUANTPLAN_MODEL_MEMORY_GIB, a larger GPU, or several GPUs")

    # -- loading and freeing

    def _place(self, names: Sequence[str], where: str) -> None:
        from accelerate.utils import set_module_tensor_to_device

        try:
            for n in names:
                value = self.reader.read(self._stored.get(n, n), where=where)
                # clear_cache=False: else accelerate probes every backend and empties its cache after every tensor
                set_module_tensor_to_device(self.model, n, self.device, value=value, dtype=self.dtype
                                            if value.is_floating_point() else None, clear_cache=False)
                del value
        finally:
            self.reader.close()  # unmap the files: their pages would count as the job's memory until then

    def _load_resident(self) -> None:
        self._place(self.resident_tensors(), "the embedding, final norm and head")
        if self._tied:
            self.model.tie_weights()
        for module in self.model.modules():  # non-persistent buffers (rotary tables) were built on the CPU
            for bname, buf in list(module.named_buffers(recurse=False)):
                if buf.device != self.device and buf.device.type != "meta":
                    module._buffers[bname] = buf.to(self.device)

    def load_block(self, i: int) -> None:
        """Read block ``i``'s weights onto the device (CheckpointError naming the file when one cannot be read; the
        block stays on ``meta`` then)."""
        names = self.block_tensors(i)
        try:
            self._place(names, f"block {i} ({self.stack.prefix}.{i})")
            if self._transform is not None:
                self._entered[i] = ExitStack()
                self._entered[i].enter_context(self._transform(i))
        except Exception:
            self.free_block(i)
            raise

    def free_block(self, i: int) -> None:
        """Send block ``i``'s weights back to ``meta`` (the transform it loaded under left first)."""
        from accelerate.utils import set_module_tensor_to_device

        entered = self._entered.pop(i, None)
        try:
            if entered is not None:
                entered.close()
        finally:
            for n in self.block_tensors(i):
                set_module_tensor_to_device(self.model, n, "meta", clear_cache=False)
        if self.device.type == "cpu":
            self._maybe_trim()

    def transform_blocks(self, transform: BlockContext) -> Any:
        """Every block loaded from now on runs under ``transform(i)``, entered when its weights are placed and left
        before they are freed (whatever runs it: :meth:`run`, a sweep, a rounding pass), until the returned handle's
        ``remove()``. A rotation folding into each block as it loads (:func:`quantcore.algorithms.rotation.
        rotate_model`); one at a time, and only while no block is loaded."""
        if self._transform is not None:
            raise PlanError("this streamed model's blocks are transformed already (one rotation at a time)")
        loaded = [i for i, b in enumerate(self.stack.blocks) if any(p.device.type != "meta" for p in b.parameters())]
        if loaded:
            raise PlanError(f"block {loaded[0]} of the streamed model is loaded: transform its blocks before they run")
        self._transform = transform
        streamed = self

        class _Removable:
            def remove(self) -> None:
                streamed._transform = None

        return _Removable()

    def _maybe_trim(self) -> None:
        """Trim the heap (:func:`_trim_heap`) once the process's resident memory, taken after a block is freed, has
        grown by more than the largest block's weights over what it was after the first block freed since the last
        trim (the working set: the freed block's and its activations' pages, which the next block reuses).
        Trimming after every block kept the resident memory flat but handed back exactly those pages, and faulting
        them in again for the next block cost more than reading it (SmolLM2 on 8 x 128 tokens: about 0.45 s of a 3 s
        pass, docs/results/streaming.md); trimmed on growth only, what the heap keeps beyond the working set stays
        under one block's weights."""
        rss = _resident_bytes()
        if rss is None:
            _trim_heap()
        elif self._working_rss is None:
            self._working_rss = rss
        elif rss - self._working_rss > self._trim_slack():
            _trim_heap()
            self._working_rss = None

    def _trim_slack(self) -> int:
        if self._slack is None:
            self._slack = max(self.block_bytes(i) for i in range(len(self.stack.blocks)))
        return self._slack

    # -- hidden states

    def state_plan(self, n_sequences: int, length: int) -> StreamPlan:
        """Where the two ``[S, L, H]`` state tensors go: the device when they fit the budget beside the resident part
        and the largest block, else host memory (on an accelerator) when the host has room, else a scratch file."""
        hidden = int(self.config.get_text_config().hidden_size)
        size = torch.finfo(self.dtype).bits // 8
        state = 2 * n_sequences * length * hidden * size
        if self.budget is None:
            return StreamPlan(str(self.device), state)
        biggest = max(self.block_bytes(i) for i in range(len(self.stack.blocks)))
        if self.resident_bytes() + biggest + state <= self.budget:
            return StreamPlan(str(self.device), state)
        if self.device.type != "cpu" and state <= available_memory("cpu") // 2:
            return StreamPlan("cpu", state)
        return StreamPlan("file", state)

    def _states(self, plan: StreamPlan, shape: Sequence[int], tag: str) -> HiddenStates:
        if plan.where != "file":
            return HiddenStates(shape, self.dtype, plan.where)
        if self._scratch is None:
            root = self._scratch_root or Path(tempfile.gettempdir())
            root.mkdir(parents=True, exist_ok=True)
            self._scratch = Path(tempfile.mkdtemp(prefix="stream-", dir=root))
        return HiddenStates(shape, self.dtype, "cpu", self._scratch / f"{tag}.bin")

    def cleanup(self) -> None:
        """Remove the scratch files of the last run (also done when :meth:`run`'s final states are released)."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    # -- running

    @contextmanager
    def _stage(self, i: int, previous: Tensor | None) -> Iterator[None]:
        """The model's forward with blocks ``0..i-1`` replayed as ``previous`` and a stop after block ``i``."""
        from quantcore.evaluation.sensitivity import _replayed

        blocks = self.stack.blocks
        replay = [self._wrap(previous)] * i if previous is not None else []
        with _replayed(blocks[:i], replay):
            handle = None
            if i < len(blocks):

                def stop(_m: nn.Module, _a: Any, out: Any) -> None:
                    raise _Stop(out)

                handle = blocks[i].register_forward_hook(stop)
            try:
                yield
            finally:
                if handle is not None:
                    handle.remove()

    _tuple_output = False

    def _wrap(self, hidden: Tensor | None) -> Any:
        return (hidden,) if self._tuple_output else hidden

    def _unwrap(self, out: Any) -> Tensor:
        if isinstance(out, tuple):
            self._tuple_output = True
            return out[0]
        return out

    def _block_pass(self, i: int, ids: Tensor, previous: Tensor | None) -> Tensor:
        with self._stage(i, previous), torch.no_grad():
            try:
                self.model(input_ids=ids.to(self.device), use_cache=False)
            except _Stop as stop:
                return self._unwrap(stop.output)
        raise PlanError(f"{type(self.model).__name__}.forward did not call decoder block {i} of {self.stack.prefix}; "
                        "streamed execution needs a model that runs every block on every pass")

    def _batches(self, i: int, ids: Tensor, ranges: Sequence[tuple[int, int]], current: HiddenStates | None,
                 out: HiddenStates) -> None:
        """Block ``i`` (loaded) on every batch of ``current``'s states (None: the embedding's), into ``out``."""
        for s, e in ranges:
            previous = current.data[s:e].to(self.device) if current is not None else None
            out.data[s:e] = self._block_pass(i, ids[s:e], previous).to(out.data.device)

    def run(self, input_ids: Tensor, *, batch_size: int, block_context: BlockContext | None = None,
            progress: Progress | None = None, should_cancel: ShouldCancel | None = None,
            rerun: Callable[[int], AbstractContextManager[Any] | None] | None = None) -> Tensor:
        """Every sequence of ``input_ids`` ``[S, L]`` through every block, in batches of ``batch_size``; block ``i`` is
        loaded, run under ``block_context(i)`` (entered after the load, left before the free) and freed. Returns the
        final hidden states ``[S, L, H]`` (the last block's outputs, before the final norm): keep them for
        :meth:`final`. ``progress(fraction, "streamed, block i/N")`` after each block. ``rerun(i)``: a context to run
        block ``i`` a second time under, once ``block_context`` has been left, its outputs replacing the first
        pass's (AWQ's search: the block with its folds in place), or None for one pass only."""
        ids = input_ids.detach().to("cpu", torch.int64)
        n, length = ids.shape
        ranges = [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
        plan = self.state_plan(n, length)
        hidden = int(self.config.get_text_config().hidden_size)
        count = len(self.stack.blocks)
        log.info("streaming %d blocks, hidden states (%s) in %s", count, gib(plan.state_bytes), plan.where)
        current: HiddenStates | None = None
        # two state buffers, each block's outputs written over the inputs of the block before it: a fresh buffer per
        # block left the heap a few MB larger after every block
        buffers: list[HiddenStates] = []
        try:
            for i in range(count):
                if should_cancel is not None and should_cancel():
                    raise Cancelled(f"streamed pass cancelled at block {i + 1}/{count}")
                if len(buffers) < 2:
                    buffers.append(self._states(plan, (n, length, hidden), f"block{i % 2}"))
                out = buffers[i % 2]
                self.load_block(i)
                try:
                    with block_context(i) if block_context is not None else nullcontext():
                        self._batches(i, ids, ranges, current, out)
                    again = rerun(i) if rerun is not None else None
                    if again is not None:
                        with again:
                            self._batches(i, ids, ranges, current, out)
                finally:
                    self.free_block(i)
                current = out
                if progress is not None:
                    progress((i + 1) / count, f"streamed, block {i + 1}/{count}")
            assert current is not None
            result = current.data if current.path is None else current.data.clone()
            buffers.clear()
            return result
        finally:
            self.cleanup()

    @contextmanager
    def final(self, input_ids: Tensor, states: Tensor) -> Iterator[nn.Module]:
        """The model with every block replayed: a forward of any batch of ``input_ids``'s sequences runs the
        embedding, the masks, the final norm and the head on ``states`` (the output of :meth:`run`). Yields the
        model, for :func:`quantcore.evaluation.batches.iter_logits` and friends."""
        ids = input_ids.detach().to("cpu", torch.int64)
        rows: dict[bytes, int] = {}
        for j in range(ids.shape[0]):
            rows.setdefault(ids[j].numpy().tobytes(), j)
        current: list[Tensor] = []

        def pick(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            batch = kwargs.get("input_ids", args[0] if args else None)
            if batch is None:
                raise PlanError("a streamed model's final pass needs input_ids")
            index = [rows[row.cpu().numpy().tobytes()] for row in batch.to(torch.int64)]
            current[:] = [states[index].to(self.device)]

        blocks = self.stack.blocks
        saved: list[tuple[nn.Module, bool, Any]] = []
        with ExitStack() as stack:
            for block in blocks:
                saved.append((block, "forward" in block.__dict__, block.__dict__.get("forward")))
                block.forward = lambda *a, **k: self._wrap(current[0])
            stack.callback(_restore, saved)
            handle = self.model.register_forward_pre_hook(pick, with_kwargs=True)
            stack.callback(handle.remove)
            body = getattr(self.model, "model", None)
            if isinstance(body, nn.Module) and body is not self.model:  # iter_logits calls the body alone
                handle2 = body.register_forward_pre_hook(pick, with_kwargs=True)
                stack.callback(handle2.remove)
            yield self.model

    def close(self) -> None:
        self.cleanup()
        self.reader.close()


def _resident_bytes() -> int | None:
    """The process's resident memory (``/proc/self/statm``), or None where there is no such file."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _trim_heap() -> None:
    """Hand the freed block's memory back to the system (glibc's ``malloc_trim``): a block's tensors are a few MB
    each, under glibc's dynamic mmap threshold once one has been freed, so without a trim the heap keeps every
    block's worth it ever held and a streamed job's resident memory creeps up to the model's size."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def _restore(saved: list[tuple[nn.Module, bool, Any]]) -> None:
    for block, had, old in saved:
        if had:
            block.forward = old
        else:
            del block.forward


def choose_stream(asked: bool | None, model_bytes: int, budget: int) -> bool:
    """Stream or not: as ``asked`` where given, else when the model's weights do not fit the budget less the
    :data:`WORKING_SHARE` a job needs besides them."""
    if asked is not None:
        return asked
    return model_bytes > budget * (1 - WORKING_SHARE)


def checkpoint_bytes(folder: str | Path, dtype: torch.dtype | str | None, device: str) -> int:
    """The bytes a stored checkpoint's weights take in the job's dtype (from the safetensors headers, none read)."""
    from quantcore.models.validation import SAFETENSORS_DTYPE_BITS, read_safetensors_header

    folder = Path(folder)
    resolved = _resolve_dtype(dtype, device)
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        for t in read_safetensors_header(path).values():
            count = 1
            for d in t.shape:
                count *= int(d)
            bits = torch.finfo(resolved).bits if isinstance(resolved, torch.dtype) else SAFETENSORS_DTYPE_BITS[t.dtype]
            total += count * bits // 8
    return total


__all__ = ["GIB", "HiddenStates", "StreamPlan", "StreamedModel", "TensorReader", "available_memory",
           "checkpoint_bytes", "choose_stream", "memory_budget"]
