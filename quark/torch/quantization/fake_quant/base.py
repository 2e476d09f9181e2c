"""The common base of the fake-quant modules (spec, switches, the class for a spec) and ``apply_format``."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from quark.torch.quantization.buffers import ResizableBuffersMixin
from quark.torch.quantization.config.config import LSQSpec, QuantizationSpec, TQTSpec
from quark.torch.quantization.config.type import QSchemeType, RoundType
from quark.torch.quantization.formats import (
    TORCH_FLOAT8,
    FloatFormat,
    IntFormat,
    PreparedGrid,
    PreparedInt,
    fake_quantize,
    format_of,
    is_scaled,
)

__all__ = ["FakeQuantizeBase", "apply_format", "prepare_fixed", "prepares_fixed"]


def _spec_kind(spec: QuantizationSpec) -> str:
    """The family of fake-quant module that realises ``spec`` (the ``kind`` its class registers under)."""
    if isinstance(spec.qat_spec, TQTSpec):
        return "tqt"
    if isinstance(spec.qat_spec, LSQSpec):
        return "lsq"
    return "scaled" if is_scaled(spec.dtype) else "non_scaled"


class FakeQuantizeBase(ResizableBuffersMixin, nn.Module):
    """Common state: the spec and the observer / fake-quant switches (buffers, so they travel in the state_dict)."""

    observer_enabled: torch.Tensor
    fake_quant_enabled: torch.Tensor
    _where: str = "a quantizer"
    #: the class ``get_fake_quantize`` builds for each kind of spec, filled as the classes are defined
    _by_kind: ClassVar[dict[str, type[FakeQuantizeBase]]] = {}

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        """``class TQTFakeQuantize(LearnableFakeQuantize, kind="tqt")``: the class ``get_fake_quantize`` builds for
        that kind of spec (``"tqt"``, ``"lsq"``, ``"scaled"``, ``"non_scaled"``)."""
        super().__init_subclass__(**kwargs)
        if kind is not None:
            FakeQuantizeBase._by_kind[kind] = cls

    @property
    def where(self) -> str:
        """Which layer and tensor this quantizer serves (set by ModelQuantizer.prepare; used in error messages, its
        observer's included)."""
        return self._where

    @where.setter
    def where(self, value: str) -> None:
        self._where = value
        observer = self._modules.get("observer")
        if observer is not None:
            observer.where = value

    def __init__(self, spec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.register_flag("observer_enabled", 1, device)
        self.register_flag("fake_quant_enabled", 1, device)

    #: the flag buffers a quantizer may have (``register_flag``)
    FLAGS: ClassVar[tuple[str, ...]] = ("observer_enabled", "fake_quant_enabled", "initialized")

    def register_flag(self, name: str, value: int, device: torch.device | None = None) -> None:
        """Register the 0-dim uint8 flag buffer ``name`` holding ``value``, and its value on the host (``flag``)."""
        self.register_buffer(name, torch.tensor(value, dtype=torch.uint8, device=device))
        self._note_flag(name, value)

    def _note_flag(self, name: str, value: int) -> None:
        """Record ``value`` as flag ``name``'s value on the host: what a ``torch.compile``d forward reads (``flag``)."""
        values = self.__dict__.get("_flag_values")
        if values is None:
            values = self.__dict__["_flag_values"] = {}
        if values.get(name) != value:
            values[name] = value

    def flag_values(self) -> dict[str, int]:
        """A copy of the host-side flag values (``flag``), to be given back with ``restore_flag_values``."""
        return dict(self.__dict__.get("_flag_values", {}))

    def restore_flag_values(self, values: dict[str, int], names: tuple[str, ...]) -> None:
        """Take back the host-side values of flags ``names`` from ``flag_values``, after those flag buffers themselves
        were written back (the other flags keep their current values; in place: a compiled graph guards them)."""
        known = self.__dict__.get("_flag_values", {})
        for name in names:
            if name in values:
                self._note_flag(name, values[name])
            else:  # unknown before: unknown again (read when next asked)
                known.pop(name, None)

    def copy_flag(self, name: str, source: FakeQuantizeBase) -> None:
        """Flag ``name`` set as ``source``'s (the buffer copied on its device, no host read; the host-side value too)."""
        self._buffers[name].copy_(source._buffers[name])  # type: ignore[union-attr]
        value = source.__dict__.get("_flag_values", {}).get(name)
        if value is None:
            self.__dict__.get("_flag_values", {}).pop(name, None)
        else:
            self._note_flag(name, value)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """Load, then read the loaded flags' values to the host (``flag``; a load is rare, a device read here is not
        per step)."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        for name in self.FLAGS:
            buf = self._buffers.get(name)
            if buf is not None and prefix + name in state_dict:
                self._note_flag(name, int(bool(buf)))

    @staticmethod
    def get_fake_quantize(spec: QuantizationSpec, device: torch.device | None = None) -> FakeQuantizeBase:
        """The fake-quant module that realises ``spec``: TQT or LSQ for those QAT specs, else scaled or non-scaled by
        the dtype (the classes register their kind where they are defined; ``tensor_quantize`` imports them all)."""
        kind = _spec_kind(spec)
        cls = FakeQuantizeBase._by_kind.get(kind)
        if cls is None:
            raise RuntimeError(
                f"no fake-quant module is registered for {kind!r} specs: import quark.torch.quantization.tensor_quantize"
            )
        return cls(spec, device)

    #: per-object memos of the flags this module wrote or read (``set_flag`` / ``flag``), of what it prepared
    #: (``ScaledFakeQuantize._prepared``, ``NonScaledFakeQuantize._prepared_block``) and of the direct kernels its steady
    #: paths keep: they vouch for these very tensors' contents by their version counters, which a copy does not carry
    #: (a deepcopied or unpickled buffer starts again at version 1), and compiled kernels belong to this process, so
    #: copies and pickles leave them behind
    _MEMOS: ClassVar[tuple[str, ...]] = (
        "_flags_known",
        "_prepared_int",
        "_fused_steady",
        "_fused_calls",
        "_block_prepared",
    )
    #: ``flag`` reads CPU flags directly (False: through the memo, as on CUDA; the tests of the CUDA path set it)
    _read_cpu_flags: ClassVar[bool] = True

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in self._MEMOS:
            state.pop(key, None)
        return state

    def _known_flag(self, name: str, buf: torch.Tensor) -> int | None:
        """The value of flag ``name`` this module last wrote or read, while nothing has written the buffer since (its
        version counter and storage say so); None when unknown."""
        known = self.__dict__.get("_flags_known")
        last = None if known is None else known.get(name)
        if last is None or last[0] is not buf or last[2] != buf._version or last[3] != buf.data_ptr():
            return None
        return last[1]

    def _remember_flag(self, name: str, buf: torch.Tensor, value: int) -> None:
        known = self.__dict__.get("_flags_known")
        if known is None:
            known = self.__dict__["_flags_known"] = {}
        # the storage's address too: ``.data = t`` and ``swap_tensors`` (``load_state_dict`` under torch.__future__'s
        # swap flag) keep the tensor object but not its storage or version counter
        known[name] = (buf, value, buf._version, buf.data_ptr())

    def flag(self, name: str) -> bool:
        """The 0-dim flag buffer ``name`` (``observer_enabled``, ``fake_quant_enabled``, ``initialized``) as a bool,
        read from its tensor only when something wrote it since this module last wrote or read it: on CUDA a read is
        a host sync, waiting for the GPU to finish all it was given, and every forward asks its switches. Writes that
        bypass the version counter are not seen (see ``set_flag``), DDP's buffer broadcast among them: set switches
        alike on every rank, or keep quantizer buffers out of the broadcast. On the CPU the tensor is read each time:
        there is nothing to wait for, and the read costs less than the memo (0.16 against 0.5 us).

        Inside a ``torch.compile``d forward the flag is the value last written through this module (``set_flag`` and
        the ``enable_*`` methods, ``load_state_dict``) or read by an eager forward: a Python value, which dynamo
        specializes the graph on and guards, so the compiled model has no graph break per quantizer and recompiles
        when a switch changes. A write straight into the buffer is seen from the next eager forward on."""
        buf = self._buffers[name]
        if torch.compiler.is_compiling():
            known = self.__dict__.get("_flag_values", {}).get(name)
            return bool(buf) if known is None else bool(known)  # (unknown: read, a graph break)
        # read directly on the CPU, and where there is no version counter (an inference tensor); else through the memo
        if (buf.is_cpu and self._read_cpu_flags) or buf.is_inference():  # type: ignore[union-attr]
            value = int(bool(buf))
        else:
            value = self._known_flag(name, buf)  # type: ignore[arg-type]
            if value is None:
                value = int(bool(buf))
                self._remember_flag(name, buf, value)  # type: ignore[arg-type]
        self._note_flag(name, value)
        return bool(value)

    def set_flag(self, name: str, value: int) -> None:
        """Write ``value`` into the 0-dim flag buffer ``name`` (observer / fake-quant switches, ``initialized``),
        skipping the write when the buffer is known to hold it already (``flag``): QAT's warm-up switches every
        observer on and marks every quantizer initialised on each batch, and a tensor write per quantizer per batch
        is not free. No read of the buffer (a device sync on CUDA). A write that bypasses the version counter
        (through ``.data``, or a ``torch.distributed`` collective on the buffer itself) is not seen: write such flags
        with ``fill_`` / ``copy_`` or ``set_flag`` itself."""
        buf = self._buffers[name]
        if torch.compiler.is_compiling() or buf.is_inference():  # type: ignore[union-attr]  # (no version counter)
            buf.fill_(value)  # type: ignore[union-attr]
            self.__dict__.get("_flags_known", {}).pop(name, None)
            self._note_flag(name, value)
            return
        self._note_flag(name, value)
        if self._known_flag(name, buf) == value:  # type: ignore[arg-type]
            return
        buf.fill_(value)  # type: ignore[union-attr]
        self._remember_flag(name, buf, value)  # type: ignore[arg-type]

    def enable_observer(self, enabled: bool = True) -> FakeQuantizeBase:
        self.set_flag("observer_enabled", int(enabled))
        return self

    def disable_observer(self) -> FakeQuantizeBase:
        return self.enable_observer(False)

    def enable_fake_quant(self, enabled: bool = True) -> FakeQuantizeBase:
        self.set_flag("fake_quant_enabled", int(enabled))
        return self

    def disable_fake_quant(self) -> FakeQuantizeBase:
        return self.enable_fake_quant(False)

    @property
    def is_dynamic(self) -> bool:
        return bool(self.spec.is_dynamic)

    @property
    def round_method(self) -> RoundType:
        """The rounding of ``x / scale`` to codes: the spec's (half_even when unset), shared with the frozen form and
        used by the exports."""
        return self.spec.round_method or RoundType.half_even

    def read_late_checks(self) -> None:
        """Wait for this quantizer's checks still on their way (``late_flag``: on CUDA a training forward's NaN / Inf
        and learned-value checks are read some forwards later) and raise the error one found. Where no later forward
        will read them: the end of a fit, a checkpoint, fixing or exporting the qparams. Here: the observer's."""
        observer = self._modules.get("observer")
        if observer is not None:
            observer.read_late_checks()

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (scale, zero_point) in use."""
        raise NotImplementedError(f"{type(self).__name__} has no scale and zero point")

    def to_frozen(self) -> nn.Module:
        """A module that applies the current quantization with nothing left to observe or learn."""
        return self

    def extra_repr(self) -> str:
        s = self.spec
        parts = [f"dtype={s.dtype.name}", f"qscheme={s.qscheme.name if s.qscheme else None}"]
        if s.ch_axis is not None:
            parts.append(f"ch_axis={s.ch_axis}")
        if s.group_size is not None:
            parts.append(f"group_size={s.group_size}")
        if s.block_size is not None:
            parts.append(f"block_size={list(s.block_size)}")
        parts.append("dynamic" if self.is_dynamic else "static")
        return ", ".join(parts)


def apply_format(
    x: torch.Tensor, spec: QuantizationSpec, scale: torch.Tensor | None, zp: torch.Tensor | None
) -> torch.Tensor:
    """``x`` fake-quantized in the spec's format with the given qparams (the one call every quantizer makes)."""
    return fake_quantize(
        x,
        spec.dtype,
        scale,
        zp,
        qscheme=spec.qscheme,
        axis=spec.ch_axis,
        group_size=spec.group_size,
        round_method=spec.round_method,
        mx_element_dtype=spec.mx_element_dtype,
        mx_scale_mode=spec.mx_scale_mode,
        block_size=spec.block_size,
    )


def prepare_fixed(
    ndim: int, spec: QuantizationSpec, scale: torch.Tensor, zp: torch.Tensor, keep: bool = False
) -> PreparedInt | PreparedGrid | None:
    """``apply_format`` with these qparams prepared for inputs of rank ``ndim``, the same bits: ``PreparedInt`` for an
    integer spec per tensor or per channel, ``PreparedGrid`` for a minifloat one (fp8, fp4, fp6; only where the
    caller keeps it: the steady path is all it adds); None for any other (those take ``apply_format``). ``keep``:
    the caller keeps it for many calls (``PreparedInt.of``)."""
    if not prepares_fixed(spec, keep):
        return None
    fmt = format_of(spec.dtype)
    axis = spec.ch_axis if spec.qscheme == QSchemeType.per_channel else None
    if isinstance(fmt, FloatFormat):
        return PreparedGrid.of(scale, fmt, TORCH_FLOAT8.get(spec.dtype), axis, ndim)
    method = spec.round_method or RoundType.half_even
    return PreparedInt.of(scale, zp, fmt.qmin, fmt.qmax, method, axis, ndim, keep=keep)  # type: ignore[union-attr]


def prepares_fixed(spec: QuantizationSpec, keep: bool = False) -> bool:
    """Whether ``prepare_fixed`` serves ``spec``: an integer (with ``keep``, also a minifloat) per tensor, or per channel
    with its axis (without one, ``apply_format`` raises the error that names it)."""
    qscheme = spec.qscheme or QSchemeType.per_tensor
    fmt = format_of(spec.dtype)
    if not (isinstance(fmt, IntFormat) or (keep and isinstance(fmt, FloatFormat))):
        return False
    return qscheme == QSchemeType.per_tensor or (qscheme == QSchemeType.per_channel and spec.ch_axis is not None)
