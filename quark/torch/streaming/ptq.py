"""PTQ of a Hugging Face checkpoint larger than memory: one decoder layer at a time, file to file.

The model is built from ``config.json`` on the meta device (no weights) and prepared by ``ModelQuantizer`` (quantized
twins around meta Parameters). The modules before the decoder stack (the embeddings) are read from the checkpoint and
the calibration batches run up to the first layer, capturing each layer's own arguments (``capture``); the embeddings
go back to meta until the end (an algorithm-free run reads them only then). Then, per
decoder layer: its Parameters are read from the shards, the algorithms run on it as the in-memory path runs them
(SmoothQuant and AWQ on the float layer with every quantizer off, then the weights observed, then GPTQ with every
quantizer off), its amd-quark tensors go to the export, and its Parameters go back to meta.

The in-memory path runs each algorithm over the whole stack before the next; here every algorithm keeps its own
stream of hidden states (what the in-memory pass of that algorithm carries from layer to layer: the outputs of the
layers it processed, before later algorithms changed them), so the results are bit for bit the same. After the
stack, the modules after it (final norm, lm_head) are read, observed and, for GPTQ, quantized on the GPTQ stream's
last hidden states, the decoder layers standing in as pass-throughs. ``config.json`` is written last and the
directory moved to its final name (``writer``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.algorithm.api import checked_gptq_targets, gptq_decoder_layer, gptq_layerwise, weight_specs
from quark.torch.algorithm.awq import awq_layer
from quark.torch.algorithm.capture import LayerInputs, capture_each_layer_inputs, hidden_of, with_hidden
from quark.torch.algorithm.smoothquant import smooth_layer
from quark.torch.cpu_allocator import release_freed_memory
from quark.torch.export.checkpoint_names import checkpoint_names
from quark.torch.export.quark_config import check_export_options
from quark.torch.export.quark_format import check_quark_exportable, quark_document
from quark.torch.export.quark_tensors import quark_tensors
from quark.torch.export.skeleton import hf_skeleton
from quark.torch.export.tied import embeddings_stored_apart
from quark.torch.quantization.api import ModelQuantizer, observe_params
from quark.torch.quantization.batches import run_batch
from quark.torch.quantization.config.config import AWQConfig, Config, GPTQConfig
from quark.torch.quantization.hf import no_kv_cache
from quark.torch.quantization.state import paused_quantizers
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from quark.torch.streaming.checkpoint import HFCheckpoint, free
from quark.torch.streaming.checks import check_config, check_prepared, decoder_stack
from quark.torch.streaming.writer import DEFAULT_SHARD_BYTES, ShardedExport, check_output_dir

__all__ = ["stream_quantize", "check_stream"]

logger = logging.getLogger(__name__)


def stream_quantize(
    checkpoint_dir: str | Path,
    config: Config | dict[str, Any],
    batches: Sequence[Any] | None,
    output_dir: str | Path,
    *,
    weight_format: str = "real_quantized",
    pack_method: str = "reorder",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> Path:
    """Quantize the Hugging Face checkpoint ``checkpoint_dir`` into amd-quark's export directory ``output_dir``,
    holding one decoder layer's weights at a time, and the calibration activations (the embeddings are read for the
    first layer's inputs and again, with the modules after the stack, at the end).

    The result equals, tensor for tensor, ``ModelQuantizer(config).quantize_model(model, batches)`` followed by
    ``export_quark_dir`` on the model ``from_pretrained`` loads from the same directory (same ``attn_implementation``).

    Args:
        checkpoint_dir: ``config.json`` and ``model.safetensors`` or shards with ``model.safetensors.index.json``.
        config: the Quark Config (or its dict): weight-only or dynamic activation specs; RTN (no algorithm),
            GPTQ, AWQ, SmoothQuant.
        batches: calibration batches as the model takes them (needed by the algorithms; RTN reads none).
        output_dir: a new or empty folder; written as ``writer.ShardedExport`` describes.
        weight_format: ``export_quark_dir``'s.
        pack_method: ``export_quark_dir``'s.
        max_shard_bytes: the largest size of a shard of the export (a larger tensor gets a shard of its own).
        attn_implementation: the attention the skeleton is built with (``from_pretrained``'s default is ``"sdpa"``).
        trust_remote_code: passed to transformers' ``AutoConfig``.

    Returns:
        The export directory.

    Raises:
        ValueError: before any weight is read, for a checkpoint with missing files or tensors, a model without a
            known decoder stack, a Config that cannot stream (``checks``), export options amd-quark does not
            have, or an output directory that is not new or empty.
    """
    config = Config.from_dict(config) if isinstance(config, dict) else config
    batches = list(batches) if batches is not None else None
    checkpoint, model, stack, layers = _checked(
        checkpoint_dir, config, batches, output_dir, weight_format, pack_method, attn_implementation, trust_remote_code
    )
    export = ShardedExport(output_dir, max_shard_bytes)
    try:
        run = _Run(model, config, checkpoint, stack, layers, batches or [], export, pack_method)
        with torch.no_grad(), no_kv_cache(model):
            run.run()
        document = quark_document(model, config, None, [], weight_format, pack_method)
        if run.embeddings_apart:  # two quantized versions of one tied weight, as export_quark_dir writes it
            document["tie_word_embeddings"] = False
        return export.finish(document)
    except BaseException:
        export.abort()
        raise


def check_stream(
    checkpoint_dir: str | Path,
    config: Config | dict[str, Any],
    batches: Sequence[Any] | None,
    output_dir: str | Path | None = None,
    *,
    weight_format: str = "real_quantized",
    pack_method: str = "reorder",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> None:
    """Every check ``stream_quantize`` makes before it reads a weight (the model built on meta and prepared, then
    dropped), for front ends that check before they commit to a run. ``output_dir`` None: not checked.

    Raises:
        ValueError: as ``stream_quantize``.
    """
    config = Config.from_dict(config) if isinstance(config, dict) else config
    batches = list(batches) if batches is not None else None
    _checked(
        checkpoint_dir, config, batches, output_dir, weight_format, pack_method, attn_implementation, trust_remote_code
    )


def _checked(
    checkpoint_dir: str | Path,
    config: Any,
    batches: list[Any] | None,
    output_dir: str | Path | None,
    weight_format: str,
    pack_method: str,
    attn_implementation: str,
    trust_remote_code: bool,
) -> tuple[HFCheckpoint, nn.Module, str, nn.ModuleList]:
    """The checks of ``stream_quantize``; returns the checkpoint, the prepared skeleton and its decoder stack."""
    if not isinstance(config, Config):
        raise ValueError(f"stream_quantize needs a Config (or its dict), got {type(config).__name__}")
    check_config(config, batches)
    check_export_options(weight_format, pack_method)
    if output_dir is not None:
        check_output_dir(output_dir)
    checkpoint = HFCheckpoint(checkpoint_dir)
    model = hf_skeleton(checkpoint.root, trust_remote_code, attn_implementation, _config_dtype(checkpoint))
    checkpoint.check_covers(model)
    stack, layers = decoder_stack(model, config)
    if checkpoint_names(model) is not None:
        raise ValueError(
            "streamed export of fused MoE experts (stored per expert under the hub's names) is not supported; "
            "quantize this model in memory"
        )
    ModelQuantizer(config).prepare(model)
    check_prepared(model)
    return checkpoint, model, stack, layers


class _Run:
    """One streamed quantization (``stream_quantize``): the model, its streams of hidden states, the export."""

    def __init__(
        self,
        model: nn.Module,
        config: Config,
        checkpoint: HFCheckpoint,
        stack: str,
        layers: nn.ModuleList,
        batches: list[Any],
        export: ShardedExport,
        pack_method: str,
    ) -> None:
        self.model, self.config, self.checkpoint, self.export = model, config, checkpoint, export
        self.stack, self.layers, self.batches, self.pack_method = stack, layers, batches, pack_method
        self.device = torch.device("cpu")
        algos = config.pre_quant_opt_configs + config.algo_configs
        self.before = [a for a in algos if not isinstance(a, GPTQConfig)]  # in the order they run
        self.gptq = next((a for a in algos if isinstance(a, GPTQConfig)), None)
        self.targets = checked_gptq_targets(model) if self.gptq is not None else {}
        self.spec_of = weight_specs(model).get
        self.losses: dict[str, float] = {}
        self.kept: dict[str, int] = {}
        self.calls: list[LayerInputs] = []  # per layer, its arguments per batch (hidden states None after layer 0)
        self.streams: list[list[torch.Tensor]] = []  # per algorithm (before, then GPTQ): the hidden states per batch
        self.last_output: Any = None  # a real output of the last layer: its structure, for the pass-throughs
        self.head, self.tail = _outside_stack(model, stack)
        self.current = 0  # the batch the pass-through stack is running (``indexed_run``)
        self.embeddings_apart = False  # ``embeddings_stored_apart`` of the modules outside the stack

    def run_batch(self, model: nn.Module, batch: Any) -> Any:
        """A calibration batch through ``model`` (as ``ModelQuantizer`` runs one)."""
        return run_batch(model, batch, self.device)

    def run(self) -> None:
        """Everything before the stack, the stack layer by layer, everything after it."""
        self.checkpoint.materialize(self.model, f"{self.stack}.0", self.device)  # the capture runs layer 0 once
        if self.before or self.gptq is not None:
            for name in self.head:
                self.checkpoint.materialize(self.model, name, self.device)
            with paused_quantizers(self.model, fake_quant=True):  # what each algorithm's own capture sees
                self.calls = capture_each_layer_inputs(self.model, self.layers, self.batches, self.run_batch)
            first = [hidden_of(args[0] if args else kwargs["hidden_states"]) for args, kwargs in self.calls[0]]
            self.streams = [list(first) for _ in range(len(self.before) + (self.gptq is not None))]
            for name in self.head:  # not needed again until the end: not resident while the stack is streamed
                free(self.model.get_submodule(name), within=self.model)
        for i, layer in enumerate(self.layers):
            if i:
                self.checkpoint.materialize(self.model, f"{self.stack}.{i}", self.device)
            self.layer(i, layer)
            logger.info("streamed PTQ: decoder layer %d/%d done", i + 1, len(self.layers))
        for name in self.head + self.tail:
            self.checkpoint.materialize(self.model, name, self.device)
        self.finish_outside()

    def inputs(self, i: int, stream: int) -> LayerInputs:
        """Layer ``i``'s calls with the hidden states of ``stream``."""
        return [with_hidden(c, h) for c, h in zip(self.calls[i], self.streams[stream], strict=True)]

    def carry(self, i: int, layer: nn.Module, stream: int) -> None:
        """``stream`` moves past layer ``i``: its hidden states become the layer's outputs on them."""
        outputs = [layer(*args, **kwargs) for args, kwargs in self.inputs(i, stream)]
        self.last_output = outputs[0]
        self.streams[stream] = [hidden_of(o) for o in outputs]

    def layer(self, i: int, layer: nn.Module) -> None:
        """Decoder layer ``i``: the algorithms before calibration, the weights observed, GPTQ, the export."""
        name = f"{self.stack}.{i}"
        quantizers = [m for m in layer.modules() if isinstance(m, FakeQuantizeBase)]
        for q in quantizers:  # as ModelQuantizer._observe: the float layer for SmoothQuant and AWQ
            q.enable_observer(False)
            q.disable_fake_quant()
        for k, algo in enumerate(self.before):
            if isinstance(algo, AWQConfig):
                awq_layer(layer, self.inputs(i, k), algo, name, self.spec_of)
            else:
                smooth_layer(layer, self.inputs(i, k), algo, name)
            self.carry(i, layer, k)
        _observe(layer)
        if self.gptq is not None:
            with paused_quantizers(layer, fake_quant=True):
                gptq_decoder_layer(name, layer, self.targets, self.inputs(i, -1), self.gptq, self.losses, self.kept)
                self.carry(i, layer, -1)
        check_quark_exportable(layer)
        tensors = quark_tensors(layer, self.config, self.pack_method, None, [])
        self.export.add({f"{name}.{k}": v for k, v in tensors.items()})
        free(layer, within=self.model)
        release_freed_memory()  # this layer's temporaries: not resident while the next one is read
        if i + 1 < len(self.calls):
            self.calls[i] = []  # its arguments are no longer needed

    def finish_outside(self) -> None:
        """The modules outside the stack: observed, GPTQ's after the stack on its last hidden states, exported."""
        _observe_outside(self.model, self.layers)
        rest = {n: m for n, m in self.targets.items() if not n.startswith(self.stack + ".")}
        if rest and self.gptq is not None:
            with paused_quantizers(self.model, fake_quant=True), self.pass_through():
                gptq_layerwise(self.model, rest, self.gptq, self.batches, self.indexed_run(), self.losses, self.kept)
        for name in self.head + self.tail:
            check_quark_exportable(self.model.get_submodule(name))
        tensors = quark_tensors(self.model, self.config, self.pack_method, None, [], skip=self.stack)
        self.embeddings_apart = embeddings_stored_apart(self.model, tensors)
        self.export.add(tensors)

    def indexed_run(self) -> Callable[[nn.Module, Any], Any]:
        """``run_batch`` that tells the pass-through stack which batch runs (by identity in ``batches``)."""
        index = {id(b): i for i, b in enumerate(self.batches)}

        def run(model: nn.Module, batch: Any) -> Any:
            self.current = index[id(batch)]
            return self.run_batch(model, batch)

        return run

    @contextmanager
    def pass_through(self) -> Iterator[None]:
        """The decoder layers return their input, the last one the GPTQ stream's hidden states of the current batch
        (in the structure the real layer returns)."""
        template = self.last_output
        last = len(self.layers) - 1

        def forward(index: int, *args: Any, **kwargs: Any) -> Any:
            hidden = self.streams[-1][self.current] if index == last else (args[0] if args else kwargs["hidden_states"])
            if isinstance(template, tuple | list):
                return type(template)((hidden, *template[1:]))
            return hidden

        with ExitStack() as restore:
            for i, layer in enumerate(self.layers):
                layer.__dict__["forward"] = partial(forward, i)
                restore.callback(layer.__dict__.pop, "forward", None)
            yield


def _config_dtype(checkpoint: HFCheckpoint) -> torch.dtype | None:
    """The dtype ``from_pretrained`` loads the model in by default: config.json's, else the checkpoint's."""
    document = json.loads((checkpoint.root / "config.json").read_text())
    named = document.get("dtype", document.get("torch_dtype"))
    return getattr(torch, named) if isinstance(named, str) and hasattr(torch, named) else checkpoint.float_dtype()


def _outside_stack(model: nn.Module, stack: str) -> tuple[list[str], list[str]]:
    """The modules holding Parameters outside the decoder stack, split at it: those registered before it (the
    embeddings, read first) and after it (final norm, lm_head, read at the end)."""
    before: list[str] = []
    after: list[str] = []
    seen_stack = False
    for name, module in model.named_modules():
        if name == stack or name.startswith(stack + "."):
            seen_stack = True
            continue
        if any(True for _ in module.parameters(recurse=False)):
            (after if seen_stack else before).append(name)
    return before, after


def _observe(module: nn.Module) -> None:
    """The weights of ``module`` observed as ``ModelQuantizer`` observes them, then every quantizer quantizing (and
    static ones no longer observing)."""
    quantizers = [m for m in module.modules() if isinstance(m, FakeQuantizeBase)]
    for q in quantizers:
        q.enable_observer()
        q.disable_fake_quant()
    try:
        observe_params(module)
    finally:
        for q in quantizers:
            q.enable_observer(q.is_dynamic)
            q.enable_fake_quant()


def _observe_outside(module: nn.Module, layers: nn.ModuleList) -> None:
    """``_observe`` on ``module`` if the decoder stack is not inside it, else on each of its children but the stack."""
    if not any(m is layers for m in module.modules()):
        _observe(module)
        return
    for child in module.children():
        if child is not layers:
            _observe_outside(child, layers)
