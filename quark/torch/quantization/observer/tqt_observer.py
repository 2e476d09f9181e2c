"""amd-quark's module path of ``TQTObserver`` (``from quark.torch.quantization.observer.tqt_observer import TQTObserver``)."""

from quark.torch.quantization.observer.observer import TQTObserver

__all__ = ["TQTObserver"]
