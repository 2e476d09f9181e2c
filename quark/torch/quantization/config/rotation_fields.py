"""RotationConfig and OnlineRotationConfig: amd-quark 0.13's rotation settings (R1/R2/R3/R4 of SpinQuant / QuaRot),
with its field names, defaults and checks. Re-exported by ``quark.torch.quantization.config.config``; run by
``quark.torch.algorithm.rotation`` (stage ``before_calibration``).

One difference: ``scaling_layers`` may be None (ours, the default), and then where R1 is folded comes from the model's
family (``quark.torch.algorithm.structure.MODEL_FAMILIES``: LLaMA-like layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quark.torch.quantization.config.algo_base import AlgoConfig
from quark.torch.quantization.config.spec import ConfigBase

__all__ = ["RotationConfig", "OnlineRotationConfig", "SCALING_LAYER_PARTS", "SCALING_LAYER_KEYS", "OWN_FIELDS"]

#: the parts of amd-quark's ``scaling_layers`` dict
SCALING_LAYER_PARTS = ("first_layer", "middle_layers", "last_layer")
#: the keys of one of its entries
SCALING_LAYER_KEYS = ("prev_modules", "norm_module", "next_modules", "target_modules")
#: RotationConfig's fields that amd-quark 0.13's has not (its constructor refuses them): training settings, left out
#: of the exported rotation entry (``to_amd_quark_dict``)
OWN_FIELDS = ("train_steps", "train_lr")
#: the rotations ``smooth_positions`` may name
SMOOTH_POSITIONS = ("r1", "r2", "r4")


@dataclass(eq=True)
class OnlineRotationConfig(ConfigBase):
    """amd-quark's settings of online rotations (kept for its configs; our online R4 is one Hadamard per layer).

    Args:
        shared_parallel (bool): Whether parallel layers share one online rotation.
        online_rotation_layers (Optional[List[str]]): The layers given online rotations.
        use_input_prescale (bool): A per-channel ``input_prescale`` buffer before the online rotation.
    """

    shared_parallel: bool
    online_rotation_layers: list[str] | None = None
    use_input_prescale: bool = False

    def __post_init__(self) -> None:
        own = "OnlineRotationConfig"
        for name in ("shared_parallel", "use_input_prescale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{own}.{name}={getattr(self, name)!r} must be true or false")
        layers = self.online_rotation_layers
        if layers is not None and not (isinstance(layers, list) and all(isinstance(v, str) for v in layers)):
            raise ValueError(f"{own}.online_rotation_layers={layers!r} must be a list of layer names or None")


def _check_scaling_layers(value: Any) -> None:
    """amd-quark's layout: a dict of ``SCALING_LAYER_PARTS`` to lists of dicts with ``SCALING_LAYER_KEYS``."""
    if value is None:
        return
    own = "RotationConfig.scaling_layers"
    if not isinstance(value, dict) or set(value) - set(SCALING_LAYER_PARTS):
        raise ValueError(f"{own}={value!r} must be None or a dict with keys among {list(SCALING_LAYER_PARTS)}")
    for part, entries in value.items():
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError(f"{own}[{part!r}] must be a list of dicts with keys {list(SCALING_LAYER_KEYS)}")
        for i, entry in enumerate(entries):
            unknown = sorted(set(entry) - set(SCALING_LAYER_KEYS))
            if unknown:
                raise ValueError(
                    f"{own}[{part!r}][{i}] has unknown key(s) {unknown}; allowed: {list(SCALING_LAYER_KEYS)}"
                )


@dataclass(eq=True)
class RotationConfig(AlgoConfig):
    """Rotations of the residual stream and the attention / MLP inputs (QuaRot, SpinQuant), amd-quark 0.13's fields.

    Args:
        scaling_layers (Optional[Dict[str, List[Dict]]]): amd-quark's ``first_layer`` / ``middle_layers`` /
            ``last_layer`` entries (``prev_modules``, ``norm_module``, ``next_modules``; ``layer_id`` and
            ``pre_layer_id`` stand for a layer's index and the one before). None (ours, the default): derived from the
            model's family.
        name (str): ``"rotation"``.
        r1 (bool): Rotate the residual stream (R1), folded into the embeddings, the layers reading it and writing it.
        r2 (bool): Rotate each attention head's values (R2), folded into v_proj's rows and o_proj's columns.
        r3 (bool): Rotate queries and keys after RoPE (R3): refused (NotImplementedError).
        r4 (bool): Online Hadamard rotation of each down_proj's input (R4), its inverse folded into the weight.
        rotation_size (Optional[int]): Block-diagonal rotations of this size (None: one of the full size).
        random_r1 (bool): R1 is a random Hadamard matrix (random signs) rather than the plain one.
        random_r2 (bool): R2 likewise.
        backbone (str): The backbone's path (amd-quark's; kept).
        model_decoder_layers (str): The decoder stack's path (a suffix of the full name is enough).
        v_proj (str): The value projection, relative to a decoder layer.
        o_proj (str): The attention output projection, relative to a decoder layer.
        self_attn (str): The attention block, relative to a decoder layer.
        mlp (str): The MLP block, relative to a decoder layer.
        online_r1_rotation (Optional[bool]): R1 applied online rather than folded: refused when true.
        online_config (Optional[OnlineRotationConfig]): Settings of online rotations.
        trainable (bool): Learned rotations (SpinQuant).
        train_smooth (Optional[bool]): Train smoothing scales along the rotations: refused when true.
        smooth_positions (Optional[List[str]]): Where those scales sit (``"r1"``, ``"r2"``, ``"r4"``).
        train_steps (int): With ``trainable``: CayleySGD steps of the learned rotations, one calibration batch each
            (cycled). Ours (amd-quark takes them from HF TrainingArguments).
        train_lr (float): With ``trainable``: CayleySGD's step size. Ours, likewise.
    """

    scaling_layers: dict[str, list[dict[str, Any]]] | None = None
    name: str = "rotation"
    r1: bool = True
    r2: bool = False
    r3: bool = False
    r4: bool = False
    rotation_size: int | None = None
    random_r1: bool = False
    random_r2: bool = False
    backbone: str = "model"
    model_decoder_layers: str = "model.layers"
    v_proj: str = "self_attn.v_proj"
    o_proj: str = "self_attn.o_proj"
    self_attn: str = "self_attn"
    mlp: str = "mlp"
    online_r1_rotation: bool | None = None
    online_config: OnlineRotationConfig | None = None
    trainable: bool = False
    train_smooth: bool | None = None
    smooth_positions: list[str] | None = None
    train_steps: int = 100
    train_lr: float = 1.5

    def __post_init__(self) -> None:
        self._check_types()
        if (self.random_r1 or self.random_r2) and self.rotation_size is not None:
            raise NotImplementedError(
                f"RotationConfig: random_r1=True or random_r2=True along with rotation_size={self.rotation_size} is "
                "not supported (amd-quark 0.13 refuses it too); set rotation_size=None or random_r1/random_r2=False"
            )
        if self.r1:
            if self.online_r1_rotation is None:
                self.online_r1_rotation = False
        elif self.online_r1_rotation is not None:
            raise ValueError(
                f"RotationConfig.online_r1_rotation={self.online_r1_rotation} has no effect along r1={self.r1}"
            )
        if self.trainable and self.r3:
            raise NotImplementedError("RotationConfig: trainable=True along r3=True is not implemented")
        if self.online_config is not None:
            if not self.online_r1_rotation and not self.r1 and not self.r4:
                raise ValueError(
                    f"RotationConfig: online_r1_rotation={self.online_r1_rotation}, r1={self.r1}, r4={self.r4}: the "
                    f"online_config given has no effect: {self.online_config}"
                )
        elif self.r1 and self.online_r1_rotation:
            self.online_config = OnlineRotationConfig(shared_parallel=False)
        if self.trainable and self.train_smooth is None:
            self.train_smooth = False
            self.smooth_positions = []
        if self.train_smooth and not self.trainable:
            raise ValueError(
                f"RotationConfig.train_smooth={self.train_smooth} along trainable={self.trainable} is not supported"
            )
        if self.train_smooth and self.smooth_positions is None:
            raise ValueError("RotationConfig.smooth_positions needs to be set when train_smooth=True, got None")

    def to_amd_quark_dict(self) -> dict[str, Any]:
        """``to_dict`` without ``OWN_FIELDS``: the rotation entry amd-quark 0.13 reads (training settings are not
        needed to load a model whose rotations are applied)."""
        return {k: v for k, v in self.to_dict().items() if k not in OWN_FIELDS}

    def _check_types(self) -> None:
        """Each field's type (YAML gives strings and numbers): ValueError naming the field and what is allowed."""
        own = "RotationConfig"
        if self.name != "rotation":
            raise ValueError(f"{own}.name={self.name!r} must be 'rotation'")
        for flag in ("r1", "r2", "r3", "r4", "random_r1", "random_r2", "trainable"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{own}.{flag}={getattr(self, flag)!r} must be true or false")
        for flag in ("online_r1_rotation", "train_smooth"):
            if getattr(self, flag) is not None and not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{own}.{flag}={getattr(self, flag)!r} must be true, false or None")
        steps = self.train_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"{own}.train_steps={steps!r} must be a positive int")
        lr = self.train_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or lr == float("inf"):
            raise ValueError(f"{own}.train_lr={lr!r} must be a positive finite number")
        size = self.rotation_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{own}.rotation_size={size!r} must be a positive int or None")
        for path in ("backbone", "model_decoder_layers", "v_proj", "o_proj", "self_attn", "mlp"):
            if not isinstance(getattr(self, path), str):
                raise ValueError(f"{own}.{path}={getattr(self, path)!r} must be a module path (a string)")
        _check_scaling_layers(self.scaling_layers)
        if isinstance(self.online_config, dict):
            self.online_config = OnlineRotationConfig.from_dict(self.online_config)
        if self.online_config is not None and not isinstance(self.online_config, OnlineRotationConfig):
            raise ValueError(
                f"{own}.online_config={self.online_config!r} must be an OnlineRotationConfig, a dict or None"
            )
        positions = self.smooth_positions
        if positions is not None and (not isinstance(positions, list) or set(positions) - set(SMOOTH_POSITIONS)):
            raise ValueError(
                f"{own}.smooth_positions={positions!r} must be None or a list among {list(SMOOTH_POSITIONS)}"
            )
