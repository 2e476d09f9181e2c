"""Every private Lightning API the callbacks rely on, in one place (torch's are in ``quark.torch.compat``).

Each wrapper says what it wraps and the Lightning versions it was checked on; when the private API is missing it
raises ``LightningCompatError`` naming the installed Lightning version and the feature that needs it, instead of an
``AttributeError`` deep inside a hook. ``tests/callbacks/test_lightning_compat.py`` checks that each one still behaves as
relied on, so a Lightning upgrade that breaks one fails there first, under the wrapper's name.
"""

from __future__ import annotations

from typing import Any

import lightning

__all__ = ["CHECKED_LIGHTNING", "LightningCompatError", "fit_dataloaders_argument", "stage_dataloaders"]

#: the Lightning versions every wrapper below was checked on
CHECKED_LIGHTNING = ("2.6",)

#: the trainer's loop per running stage (``trainer.state.fn`` values), whose data source gives that stage's loaders
STAGE_LOOPS = {"fit": "fit_loop", "validate": "validate_loop", "test": "test_loop", "predict": "predict_loop"}


class LightningCompatError(ValueError):
    """A private Lightning API the callbacks rely on is missing or changed in the installed Lightning."""


def _data_source(trainer: Any, loop_name: str, feature: str) -> Any | None:
    """``trainer.<loop_name>._data_source`` (Lightning's ``_DataConnectorSource``: what the stage was given), None
    when the trainer has no such loop; LightningCompatError when the loop has no data source."""
    loop = getattr(trainer, loop_name, None)
    if loop is None:
        return None
    try:
        return loop._data_source
    except AttributeError:
        raise LightningCompatError(
            f"{feature} relies on Lightning's private {type(loop).__name__}._data_source, which lightning "
            f"{lightning.__version__} does not have (checked on lightning {', '.join(CHECKED_LIGHTNING)}); install "
            "one of those versions or give calib_dataloader="
        ) from None


def stage_dataloaders(trainer: Any, stage: str) -> Any | None:
    """The dataloader(s) the running ``stage`` ("fit", "validate", "test", "predict") reads, as Lightning resolves
    them (the loaders given to ``trainer.fit/validate/...``, else the datamodule's or module's method), None when
    nothing is defined; through ``trainer.<stage>_loop._data_source``. Checked on lightning 2.6."""
    loop_name = STAGE_LOOPS.get(str(getattr(stage, "value", stage)))
    source = _data_source(trainer, loop_name, "QuantCallback's example batch") if loop_name else None
    if source is None or not source.is_defined():
        return None
    return source.dataloader()


def fit_dataloaders_argument(trainer: Any) -> Any | None:
    """What was given as ``trainer.fit(model, train_dataloaders=...)`` (a loader, a list of them, ...), None when
    fit was given a datamodule or nothing; through ``trainer.fit_loop._data_source``. Checked on lightning 2.6."""
    source = _data_source(trainer, "fit_loop", "QuantCallback's calibration data")
    if source is None or source.is_module():
        return None
    return source.instance
