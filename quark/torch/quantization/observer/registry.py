"""The one list of observers: every ``ObserverBase`` subclass registers itself here by class name (and, where
amd-quark's spec helpers name it, by its ``observer_method``), and every place that needs an observer by name reads
it from here (``QuantizationSpec.observer_cls``, the spec helpers' ``observer_method``, ``OBSERVER_MAP``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quark.torch.quantization.observer.base import ObserverBase

__all__ = ["register_observer", "observer_class", "observer_names", "observer_methods", "OBSERVER_MAP"]

#: class name -> observer class (amd-quark's ``observer_cls`` strings), filled by ``ObserverBase.__init_subclass__``
OBSERVER_MAP: dict[str, type[ObserverBase]] = {}
#: amd-quark's ``observer_method`` names (``"min_max"``) -> observer class name
_METHODS: dict[str, str] = {}


def register_observer(cls: type[ObserverBase], method: str | None = None) -> None:
    """Register ``cls`` under its class name (and ``method``); a second, different class of the same name is refused,
    so a name always means one observer."""
    known = OBSERVER_MAP.get(cls.__name__)
    if known is not None and known is not cls and known.__qualname__ != cls.__qualname__:
        raise ValueError(
            f"observer name {cls.__name__!r} is taken by {known.__module__}.{known.__qualname__}; "
            f"rename {cls.__module__}.{cls.__qualname__}"
        )
    OBSERVER_MAP[cls.__name__] = cls
    if method is not None:
        _METHODS[method] = cls.__name__


def observer_names() -> list[str]:
    """Every registered observer's class name, sorted (what ``observer_cls`` accepts)."""
    return sorted(OBSERVER_MAP)


def observer_methods() -> dict[str, str]:
    """amd-quark's ``observer_method`` names -> observer class names."""
    return dict(_METHODS)


def observer_class(value: Any, owner: str = "QuantizationSpec.observer_cls") -> type[ObserverBase] | None:
    """The observer class ``value`` names (a registered class or its class name); None stays None. ValueError names
    ``owner`` and the allowed names otherwise."""
    if value is None:
        return None
    cls = OBSERVER_MAP.get(value) if isinstance(value, str) else value
    if not (isinstance(cls, type) and OBSERVER_MAP.get(cls.__name__) is cls):
        raise ValueError(f"{owner}={value!r} is not an observer; allowed: {observer_names()}")
    return cls
