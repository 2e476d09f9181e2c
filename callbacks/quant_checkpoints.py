"""Checkpoints of quantized models: the marker key, float-checkpoint load hooks, safe reading and loading for inference."""

from __future__ import annotations

import collections
import contextlib
import pickle
import re
import typing
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from callbacks.graph_capture import prepare_graphs_like
from callbacks.quantizer_state import is_learnable
from quark.torch import ModelQuantizer
from quark.torch.quantization import graph
from quark.torch.quantization.api import uncalibrated_layers
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.nn.modules import QuantMixin, iter_quantizers
from quark.torch.quantization.online_rotation import install_online_rotations
from quark.torch.quantization.resolve import config_from_stored
from quark.torch.quantization.state import ensure_quant_state, quant_state
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

# Written into the state_dict of every checkpoint of a quantized model: a plain ``Model.load_from_checkpoint`` (no
# callback, float layers) then fails on this key first, and the key says what to use. The callback's load pre-hook and
# ``load_quantized_checkpoint`` drop it.
QUANTIZED_CHECKPOINT_KEY = "QUANTIZED checkpoint: load it with callbacks.quant.load_quantized_checkpoint(model, path)"


def quantizer_keys(module: nn.Module, prefix: str = "") -> dict[str, FakeQuantizeBase]:
    """state_dict key -> quantizer, for every buffer and Parameter of the quantizers of ``module``."""
    return {
        f"{prefix}{name}.{key}": m
        for name, m in module.named_modules()
        if isinstance(m, FakeQuantizeBase)
        for key in m.state_dict()
    }


def fill_float_checkpoint(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook of a model prepared by QuantCallback: drops the quantized-checkpoint marker, and a state_dict of
    the float model (no quantizer key at all) gets the quantizers' current state, so that the float weights load
    strictly and the quantizers start fresh (the callback then calibrates, or runs its QAT observers)."""
    state_dict.pop(prefix + QUANTIZED_CHECKPOINT_KEY, None)
    quant_keys = quantizer_keys(module, prefix)
    if not quant_keys or any(k in state_dict for k in quant_keys):
        return
    if not any(k.startswith(prefix) for k in state_dict):
        return  # nothing of this model: strict loading reports it
    current = module.state_dict(prefix=prefix)
    for key in quant_keys:
        state_dict[key] = current[key].detach().clone()
    state = ensure_quant_state(module)
    state.float_start = True  # taken (once) by the callback


def _checkpoint_safe_globals() -> list[Any]:
    """What a Lightning checkpoint holds besides tensors and plain containers when a model's hyper-parameters are
    omegaconf containers (a Hydra-built model given a DictConfig/ListConfig, or ``save_hyperparameters(cfg)``): data
    classes whose unpickling only fills in attributes. Anything else (a class, a function) is refused."""
    try:
        from omegaconf import DictConfig, ListConfig
        from omegaconf.base import ContainerMetadata, Metadata
        from omegaconf.nodes import AnyNode
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return []
    return [
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        AnyNode,
        typing.Any,
        dict,
        list,
        int,
        collections.defaultdict,
    ]


_IF_TRUSTED = (
    "Checkpoints written by QuantCallback hold only tensors and plain containers; a checkpoint you wrote yourself "
    "loads once saved that way (e.g. torch.save({'state_dict': module.state_dict()}, path))."
)
_TORCH_ADVICE = ("weights only load failed", "weights_only", "please file an issue", "check the documentation")


def _refused_object(message: str) -> str | None:
    """What a weights-only load refused to create, from torch's message (any wording: a GLOBAL, or an object)."""
    found = re.search(r"\bGLOBAL (\S+?)\.?(?:\s|$)", message) or re.search(r"but got (.+?)\.?$", message, re.MULTILINE)
    return found.group(1) if found else None


def _unpickler_detail(message: str) -> str:
    """The weights-only unpickler's own reason, without torch's advice around it (which suggests
    ``weights_only=False``: running the file's code)."""
    for line in message.splitlines():
        line = re.sub(r"^.*WeightsUnpickler error:\s*", "", line).strip()
        if line and not any(advice in line.lower() for advice in _TORCH_ADVICE):
            return line
    return "refused by torch.load(weights_only=True)"


def read_checkpoint(
    path: str, map_location: Any = "cpu", name: str | None = None, if_trusted: str = _IF_TRUSTED
) -> Any:
    """``torch.load(path, weights_only=True)`` of a user's file (plus the omegaconf containers Lightning stores as
    hyper-parameters): no code in it runs. A file it refuses, or cannot read, is a ValueError naming it (``name``,
    default the path) and what it tried to create, with ``if_trusted`` (how to write a loadable file); no message
    suggests loading it unsafely."""
    name = name or str(path)
    allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5; before: plain data only
    try:
        with allow(_checkpoint_safe_globals()) if allow else contextlib.nullcontext():
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        refused = _refused_object(str(err))
        if refused is None:
            raise ValueError(
                f"{name} is not a checkpoint torch.load can read ({_unpickler_detail(str(err))})"
            ) from None
        raise ValueError(
            f"{name} was refused: it holds objects other than tensors and plain containers (it tried to load "
            f"{refused}); unpickling those can run code, so the file is read with torch.load(weights_only=True) only "
            f"and nothing in it was run. {if_trusted}"
        ) from None
    except (RuntimeError, EOFError) as err:  # a truncated or corrupted file
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{name} is not a checkpoint torch.load can read ({detail})") from None


class FoldForCheckpoint:
    """Load pre-hook (graph mode): a state_dict saved after PTQ folded the BatchNorms loads into a model whose conv +
    BatchNorm units are not folded yet by folding them first (the folded values then come from the file)."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if graph.is_folded_state(module, state_dict, prefix):
            graph.fold_and_equalize(module, self.config, structure_only=True)


def load_quantized_checkpoint(
    model: nn.Module, checkpoint_path: str, map_location: Any = "cpu", freeze: bool = True
) -> nn.Module:
    """Load a checkpoint written with QuantCallback into a fresh (float) ``model`` for inference, without a Trainer.

    The file is read with ``torch.load(weights_only=True)`` (a file holding other objects is refused with a
    ValueError). The Config stored by the callback prepares ``model``, the weights and every qparam load with
    ``strict=True``, and (``freeze=True``) the quantizers are frozen. Returns the model in eval mode.
    """
    checkpoint = read_checkpoint(checkpoint_path, map_location)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{checkpoint_path} is not a Lightning checkpoint (no state_dict)")
    states = [v for k, v in (checkpoint.get("callbacks") or {}).items() if str(k).startswith("QuantCallback")]
    if not states:
        raise ValueError(
            f"{checkpoint_path} holds no QuantCallback state; was it written by a Trainer with QuantCallback?"
        )
    quantizer = ModelQuantizer(config_from_stored(states[0]["config"]))
    state = {k: v for k, v in checkpoint["state_dict"].items() if k != QUANTIZED_CHECKPOINT_KEY}
    if not any(isinstance(m, QuantMixin) for m in model.modules()):
        if quantizer.graph_mode:
            prepare_graphs_like(model, quantizer, states[0].get("graph_inputs") or {}, checkpoint_path)
        else:
            quantizer.prepare(model)
    if quantizer.graph_mode and graph.is_folded_state(model, state):
        graph.fold_and_equalize(model, quantizer.config, structure_only=True)
    missing: dict[str, list[str]] = {}
    for key, q in quantizer_keys(model).items():
        if key not in state:
            missing.setdefault(q.where, []).append(key.rsplit(".", 1)[-1])
    if missing:
        listed = "; ".join(f"{where}: {', '.join(keys)}" for where, keys in missing.items())
        raise ValueError(
            f"{checkpoint_path} has no quantizer state for {listed}. Was it written for this model with the Config "
            "it stores (the same layers quantized)?"
        )
    install_online_rotations(
        model, state, quantizer.config
    )  # <layer>.input_rotation of a rotated model: buffer and pre-hook
    model.load_state_dict(state, strict=True)
    for _, q in iter_quantizers(model):
        if not q.is_dynamic:
            q.disable_observer()
    try:
        unreached = uncalibrated_layers(model)
    except ValueError as err:
        raise ValueError(f"{checkpoint_path}: {err}") from err
    if freeze:
        ModelQuantizer.freeze(model)  # the unreached layers run in float, named in a warning
    elif unreached:
        rank_zero_warn(
            f"{checkpoint_path}: layer(s) that no calibration or training batch reached have no activation qparams and "
            f"raise if a forward reaches them (freeze=True runs them in float): {sorted(unreached)}"
        )
    return model.eval()


class FloatCheckpointStart:
    """Mixin of QuantCallback: a float checkpoint restored into the quantized module starts the quantizers over."""

    def _check_float_optimizer_state(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """QAT from a float checkpoint with learnable quantizers: the float optimizer state has no entry for their
        thresholds, so an optimizer over ``self.parameters()`` cannot take it; say so before torch's size mismatch."""
        if self.mode != "qat" or trainer.state.fn != TrainerFn.FITTING or not checkpoint.get("optimizer_states"):
            return
        quantizer_params = {id(p) for _, q in iter_quantizers(pl_module) for p in q.parameters()}
        learnable = [q.where for _, q in iter_quantizers(pl_module) if is_learnable(q)]
        float_params = [p for p in pl_module.parameters() if id(p) not in quantizer_params]
        saved = sum(len(g["params"]) for opt in checkpoint["optimizer_states"] for g in opt.get("param_groups", []))
        if learnable and quantizer_params and saved == len(float_params):
            raise ValueError(
                f"QuantCallback(mode='qat'): the float checkpoint's optimizer state covers the {saved} float "
                f"parameters, but QAT adds {len(quantizer_params)} learnable quantizer parameter(s) ({learnable[0]}, ...), "
                "so it cannot be restored into the new optimizer. Start QAT from the float weights alone: "
                "model.load_state_dict(torch.load(path, weights_only=True)['state_dict']) and trainer.fit(model) "
                "without ckpt_path (or use an observer-based config, whose optimizer state matches)."
            )

    def _take_float_start(self, pl_module: LightningModule) -> None:
        """After a float checkpoint was loaded into the quantized module (see ``fill_float_checkpoint``): the
        quantizers start over: PTQ calibrates before evaluating (or at the end of fit), QAT observes from its first
        batch."""
        state = quant_state(pl_module)
        if state is None or not state.float_start:
            return
        state.float_start = False
        self.calibrated = False
        self._calibrated_for = None
        for _, q in iter_quantizers(pl_module):
            if q.is_dynamic:
                continue
            observer = getattr(q, "observer", None)
            if observer is not None:
                observer.reset_state()
            if is_learnable(q) and isinstance(getattr(q, "initialized", None), torch.Tensor):
                q.set_flag("initialized", 0)  # thresholds initialise again from the first batch
        if self.mode == "ptq":
            self._set_all(pl_module, observe=False, fake_quant=False)
        else:
            self._batches_seen = 0
            self._observing = True
            self._learnable_synced = False
        rank_zero_info(
            "QuantCallback: float checkpoint loaded (no quantizer state): "
            + ("calibrating before evaluation" if self.mode == "ptq" else "QAT starts from these weights")
        )
