"""amd-quark's module path of ``LSQObserver`` (``from quark.torch.quantization.observer.lsq_observer import LSQObserver``)."""

from quark.torch.quantization.observer.observer import LSQObserver

__all__ = ["LSQObserver"]
