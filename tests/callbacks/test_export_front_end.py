"""QuantCallback's ``export=`` goes through the export front end: ``export=["quark"]`` writes amd-quark's directory
at the end of fit, which amd-quark's public import reads back to the same outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cb_helpers import BoringMLP, DataModule, make_trainer, seed

from callbacks.quant import QuantCallback
from quark_lightning.tasks.recipes import recipe


def test_callback_exports_amd_quark_directory(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from quark.torch.export import import_model_from_safetensors

    seed()
    model, dm = BoringMLP(), DataModule(n=64)
    callback = QuantCallback(
        recipe("w8a8_int8"),
        mode="ptq",
        calib_batches=2,
        progress_bar=False,
        export=["quark"],
        export_dir=str(tmp_path / "out"),
    )
    trainer = make_trainer(tmp_path, [callback])
    trainer.fit(model, datamodule=dm)
    trainer.test(model, datamodule=dm, verbose=False)
    info = callback.exported["quark"]
    assert Path(info["path"]) == tmp_path / "out" / "quark"
    assert (Path(info["path"]) / "config.json").is_file() and Path(info["weights"]).is_file()
    restored = import_model_from_safetensors(BoringMLP(), info["path"])
    x = torch.randn(6, model.fc1.in_features)
    with torch.no_grad():
        assert torch.equal(restored(x), model.eval()(x))
