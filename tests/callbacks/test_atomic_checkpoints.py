"""Files are complete under their final name or absent: ``AtomicCheckpointIO`` (checkpoints, QuantCallback's
quantized.ckpt) and the exporters, on a full disk (a real 1 MiB tmpfs where a mount is permitted, else a simulated
ENOSPC midway through the write): the final name keeps the previous complete file, or nothing, and no temporary is
left. Lightning's own TorchCheckpointIO leaves a truncated .ckpt there ("failed finding central directory")."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cb_helpers import BoringMLP, DataModule, QuantCallback, make_trainer, minmax_config, seed
from lightning.pytorch.plugins.io import TorchCheckpointIO

import callbacks.checkpoint_io as checkpoint_io
from callbacks import AtomicCheckpointIO
from quark.torch import ModelQuantizer
from quark.torch.export import export_safetensors
from quark.torch.export.files import TEMP_PREFIX, is_temporary, remove_stale_temporaries, write_atomically
from quark_lightning.tasks.recipes import recipe

ROOT = Path(__file__).resolve().parents[2]


def _disk_full_after(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...] = ()) -> list[str]:
    """``AtomicCheckpointIO`` writes half a checkpoint then fails with ENOSPC (only for targets named in ``names``, or
    every one); returns the temporaries it was given."""
    real = checkpoint_io._save
    seen: list[str] = []

    def half_then_full(checkpoint: dict[str, Any], tmp: str) -> None:
        seen.append(tmp)
        if names and not any(Path(tmp).name.startswith(f"{TEMP_PREFIX}{n}.") for n in names):
            return real(checkpoint, tmp)
        real(checkpoint, tmp)
        size = os.path.getsize(tmp)
        with open(tmp, "r+b") as f:
            f.truncate(size // 2)  # what a full disk leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)

    monkeypatch.setattr(checkpoint_io, "_save", half_then_full)
    return seen


def _no_temporaries(folder: Path) -> None:
    left = [p for p in folder.rglob("*") if is_temporary(p.name) or p.name.endswith(".tmp")]
    assert not left, left


def _fitted(tmp_path: Path, callbacks: list[Any] | None = None, **overrides: Any) -> tuple[Any, BoringMLP]:
    seed(0)
    model = BoringMLP()
    trainer = make_trainer(tmp_path, callbacks or [], limit_train_batches=2, limit_val_batches=0, **overrides)
    trainer.fit(model, datamodule=DataModule())
    return trainer, model


# ----------------------------------------------------------------------------------------------- the plugin
def test_the_temporary_lies_in_the_destination_folder_and_is_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    real = checkpoint_io._save
    monkeypatch.setattr(checkpoint_io, "_save", lambda c, tmp: (seen.append(tmp), real(c, tmp))[1])
    AtomicCheckpointIO().save_checkpoint({"w": torch.arange(5.0)}, tmp_path / "sub" / "a.ckpt")
    assert len(seen) == 1 and Path(seen[0]).parent == tmp_path / "sub" and is_temporary(Path(seen[0]).name)
    assert torch.load(tmp_path / "sub" / "a.ckpt")["w"].equal(torch.arange(5.0))
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["a.ckpt"]
    AtomicCheckpointIO().save_checkpoint(
        {"w": torch.ones(2)}, f"file://{tmp_path / 'b.ckpt'}"
    )  # a file:// URL is local
    assert torch.load(tmp_path / "b.ckpt")["w"].equal(torch.ones(2)) and len(seen) == 2


def test_trainer_save_checkpoint_keeps_the_previous_file_when_the_disk_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, model = _fitted(tmp_path, plugins=[AtomicCheckpointIO()])
    path = tmp_path / "ckpt" / "last.ckpt"
    trainer.save_checkpoint(path)
    before = path.read_bytes()
    seen = _disk_full_after(monkeypatch)
    with torch.no_grad():
        model.fc1.weight.add_(1.0)  # the next checkpoint would differ
    with pytest.raises(OSError) as err:
        trainer.save_checkpoint(path)
    assert err.value.errno == errno.ENOSPC and len(seen) == 1
    assert path.read_bytes() == before  # the previous complete file, untouched
    assert "state_dict" in torch.load(path, weights_only=False)
    with pytest.raises(OSError):
        trainer.save_checkpoint(tmp_path / "ckpt" / "new.ckpt")
    assert not (tmp_path / "ckpt" / "new.ckpt").exists()  # a new name: nothing at all
    _no_temporaries(tmp_path)


def test_a_failing_sync_is_a_failed_write_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk may only show when the data is flushed (delayed allocation, NFS): the fsync error fails the write."""
    (tmp_path / "a.ckpt").write_bytes(b"previous")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(3)}, tmp_path / "a.ckpt")
    assert (tmp_path / "a.ckpt").read_bytes() == b"previous"
    _no_temporaries(tmp_path)


# ----------------------------------------------------------------------------------------------- QuantCallback
def test_quant_callback_installs_it_in_place_of_lightnings_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO"):
        trainer, _ = _fitted(tmp_path, [QuantCallback(minmax_config(), mode="ptq", calib_batches=1, log_sqnr=False)])
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    assert sum("checkpoints are written atomically" in r.getMessage() for r in caplog.records) == 1
    quantized = Path(trainer.callbacks[0].quantized_checkpoint)
    assert quantized.name == "quantized.ckpt" and "state_dict" in torch.load(quantized, weights_only=False)


def test_quant_callback_keeps_a_checkpoint_io_of_the_users(tmp_path: Path) -> None:
    class Mine(TorchCheckpointIO):
        pass

    mine = Mine()
    trainer, _ = _fitted(
        tmp_path, [QuantCallback(minmax_config(), mode="ptq", calib_batches=1, log_sqnr=False)], plugins=[mine]
    )
    assert trainer.strategy.checkpoint_io is mine


def test_quantized_ckpt_is_the_previous_one_or_absent_when_the_disk_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = QuantCallback(minmax_config(), mode="ptq", calib_batches=1, log_sqnr=False)
    _fitted(tmp_path / "first", [callback])  # default CheckpointIO: the callback installs the atomic one
    quantized = tmp_path / "first" / "quantized.ckpt"
    before = quantized.read_bytes()
    _disk_full_after(monkeypatch, names=("quantized.ckpt",))
    with pytest.raises(OSError, match="No space left"):
        _fitted(
            tmp_path / "first",
            [QuantCallback(minmax_config(), mode="ptq", calib_batches=1, log_sqnr=False)],
            max_epochs=2,
        )
    assert quantized.read_bytes() == before
    with pytest.raises(OSError, match="No space left"):
        _fitted(tmp_path / "second", [QuantCallback(minmax_config(), mode="ptq", calib_batches=1, log_sqnr=False)])
    assert not (tmp_path / "second" / "quantized.ckpt").exists()
    _no_temporaries(tmp_path)


# ----------------------------------------------------------------------------------------------- exports
def _quantized_linear(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n, n)).eval()
    ModelQuantizer(recipe("w8a8_int8")).quantize_model(model, [torch.rand(4, n)])
    return model


def test_an_export_on_a_full_disk_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch as st

    first = export_safetensors(_quantized_linear(8), tmp_path)
    before = first.read_bytes()
    real = st.save_file

    def half_then_full(tensors: dict[str, torch.Tensor], filename: str, metadata: Any = None) -> None:
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(st, "save_file", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        export_safetensors(_quantized_linear(16), tmp_path)
    assert first.read_bytes() == before
    with pytest.raises(OSError, match="No space left"):
        export_safetensors(_quantized_linear(16), tmp_path / "new")
    assert not (tmp_path / "new" / first.name).exists()
    _no_temporaries(tmp_path)


def test_stale_temporaries_are_recognised_and_removed(tmp_path: Path) -> None:
    """What a killed writer leaves (``.quarkl-tmp.<name>.<8 random>``, files or folders) goes; other files stay, also
    ones named like other tools' temporaries (``.<name>.<8 random>.tmp``), and nothing is followed through a link."""
    (tmp_path / "export" / "quark").mkdir(parents=True)
    stale = [
        tmp_path / ".quarkl-tmp.results.json.a1b2c3d4",
        tmp_path / "export" / "quark" / ".quarkl-tmp.model.safetensors.zz_9xy01",
    ]
    for path in stale:
        path.write_bytes(b"half")
    (tmp_path / "export" / ".quarkl-tmp.tokenizer.abcdefgh").mkdir()
    (tmp_path / "export" / ".quarkl-tmp.tokenizer.abcdefgh" / "tokenizer.json").write_text("{")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".quarkl-tmp.x.bin.abcdefgh").write_bytes(b"not under the folders")
    (tmp_path / "export" / "linked").symlink_to(elsewhere, target_is_directory=True)
    (tmp_path / ".quarkl-tmp.link.abcdefgh").symlink_to(elsewhere / ".quarkl-tmp.x.bin.abcdefgh")
    kept = [
        tmp_path / "notes.tmp",
        tmp_path / ".hidden",
        tmp_path / "export" / "model.safetensors",
        tmp_path / ".x.tmp",
        tmp_path / ".results.json.a1b2c3d4.tmp",
        tmp_path / ".notes.abcdefgh.tmp",
    ]
    for path in kept:
        path.write_bytes(b"mine")
    removed = remove_stale_temporaries([tmp_path], recursive=[tmp_path / "export"])
    assert sorted(removed) == sorted([*stale, tmp_path / "export" / ".quarkl-tmp.tokenizer.abcdefgh"])
    assert all(p.exists() for p in kept) and not any(p.exists() for p in stale)
    assert not (tmp_path / "export" / ".quarkl-tmp.tokenizer.abcdefgh").exists()
    assert (elsewhere / ".quarkl-tmp.x.bin.abcdefgh").read_bytes() == b"not under the folders"
    assert (tmp_path / ".quarkl-tmp.link.abcdefgh").is_symlink()
    path = write_atomically(tmp_path, "x.bin", lambda tmp: Path(tmp).write_bytes(b"1"))  # its own temporary matches
    assert path.read_bytes() == b"1"


# ----------------------------------------------------------------------------------------------- a real full disk
_ON_TMPFS = r"""
import errno, json, os, sys
from pathlib import Path
import torch
from lightning.pytorch import LightningModule, Trainer
from callbacks import AtomicCheckpointIO
from quark.torch import ModelQuantizer
from quark.torch.export import export_safetensors
from quark_lightning.tasks.recipes import recipe

d = Path(sys.argv[1])
out = {}

class Net(LightningModule):
    def __init__(self, n):
        super().__init__()
        self.fc = torch.nn.Linear(n, n)
    def training_step(self, batch, i):
        return self.fc(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

def trainer_with(n):
    model = Net(n)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.rand(2, n)), batch_size=2)
    trainer = Trainer(plugins=[AtomicCheckpointIO()], max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", default_root_dir=str(d))
    trainer.fit(model, data)
    return trainer

def attempt(fn):
    try:
        fn()
        return "ok"
    except Exception as err:
        return "enospc" if "No space left" in str(err) or getattr(err, "errno", None) == errno.ENOSPC else repr(err)

ckpt = d / "ckpt" / "float-epoch0.ckpt"
trainer_with(16).save_checkpoint(ckpt)
before = ckpt.read_bytes()
out["ckpt_big"] = attempt(lambda: trainer_with(640).save_checkpoint(ckpt))   # 1.6 MB of weights > 1 MiB
out["ckpt_kept"] = ckpt.read_bytes() == before and "state_dict" in torch.load(ckpt, weights_only=False)
out["ckpt_new"] = attempt(lambda: trainer_with(640).save_checkpoint(d / "ckpt" / "quantized.ckpt"))
out["ckpt_new_absent"] = not (d / "ckpt" / "quantized.ckpt").exists()

def quantized(n):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n, n)).eval()
    ModelQuantizer(recipe("w8a8_int8")).quantize_model(model, [torch.rand(4, n)])
    return model

weights = export_safetensors(quantized(64), d / "export")
before = weights.read_bytes()
out["export_big"] = attempt(lambda: export_safetensors(quantized(1200), d / "export"))  # 1.4 MB of int8 codes
out["export_kept"] = weights.read_bytes() == before
out["files"] = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
print("RESULT " + json.dumps(out))
"""


def test_on_a_real_full_filesystem(tmp_path: Path) -> None:
    """A 1 MiB tmpfs, mounted in a private mount namespace (``unshare -rm``: no root needed where user namespaces are
    allowed); skipped where mounting is not permitted."""
    unshare = shutil.which("unshare")
    if unshare is None or sys.platform != "linux":
        pytest.skip("needs unshare (util-linux) on Linux")
    mnt = tmp_path / "small"
    mnt.mkdir()
    probe = subprocess.run(
        [unshare, "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mnt}"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()[:200]}")
    script = tmp_path / "on_tmpfs.py"
    script.write_text(_ON_TMPFS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = f'mount -t tmpfs -o size=1m tmpfs {mnt} && exec "{sys.executable}" {script} {mnt}'
    proc = subprocess.run([unshare, "-rm", "sh", "-c", command], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["ckpt_big"] == "enospc" and result["ckpt_kept"] is True, result
    assert result["ckpt_new"] == "enospc" and result["ckpt_new_absent"] is True, result
    assert result["export_big"] == "enospc" and result["export_kept"] is True, result
    assert result["files"] == ["ckpt/float-epoch0.ckpt", "export/config.json", "export/model.safetensors"], (
        result
    )  # no .tmp
