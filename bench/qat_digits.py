"""QAT quality with Lightning on the digits CNN: W4A8 TQT (both threshold inits) against FP32 and W4A8 PTQ.

Train FP32 with Lightning; PTQ copies of it (W8A8 int8, W4A8 per-tensor pof2: the format TQT learns) through
``QuantCallback(mode="ptq")`` + ``trainer.test``; QAT: fine-tune copies with ``QuantCallback(mode="qat")`` and
TQT thresholds initialised by ``_3SD`` or ``_LL_J``.

    python bench/qat_digits.py                    # embedded 8x8 digits (~10 s)
    python bench/qat_digits.py --data fashion     # Fashion-MNIST (Debian dataset-fashion-mnist), harder (~minutes)
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import lightning as L

from callbacks import QuantCallback
from quark_lightning.tasks.lightning_digits import DigitsClassifier, DigitsDataModule
from quark_lightning.tasks.recipes import recipe


def _trainer(tmp: str, epochs: int, callbacks: list) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
        accelerator="cpu",
        num_sanity_val_steps=0,
    )


def run(
    data: str = "digits", fp32_epochs: int = 12, qat_epochs: int = 4, seed: int = 0, tmp: str = "/tmp/qat_digits"
) -> dict[str, float]:
    """Test accuracy (%) of FP32, the PTQ recipes and the QAT recipes."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(seed, verbose=False)
    if data == "fashion":
        from quark_lightning.tasks.fashion import FashionDataModule

        dm: L.LightningDataModule = FashionDataModule(seed=seed)
        model = DigitsClassifier(width=16)
    else:
        dm = DigitsDataModule(seed=seed)
        model = DigitsClassifier()
    trainer = _trainer(tmp, fp32_epochs, [])
    trainer.fit(model, datamodule=dm)
    results = {"fp32": trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]}
    for name in ("w8a8_int8", "w4a8_pof2"):
        ptq = copy.deepcopy(model)
        cb = QuantCallback(recipe(name), mode="ptq", calib_batches=8, progress_bar=False, log_sqnr=False)
        results[f"{name} PTQ"] = _trainer(tmp, 1, [cb]).test(ptq, datamodule=dm, verbose=False)[0]["test_acc"]
    for name in ("w4a8_tqt_3sd", "w4a8_tqt_ll_j"):
        L.seed_everything(seed, verbose=False)
        qat = copy.deepcopy(model)
        qat.hparams.lr = 5e-4  # fine-tuning from the FP32 weights
        cb = QuantCallback(recipe(name), mode="qat", log_sqnr=False)
        qat_trainer = _trainer(tmp, qat_epochs, [cb])
        qat_trainer.fit(qat, datamodule=dm)
        results[f"{name} QAT"] = qat_trainer.test(qat, datamodule=dm, verbose=False)[0]["test_acc"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=["digits", "fashion"], default="digits")
    parser.add_argument("--fp32-epochs", type=int, default=None)
    parser.add_argument("--qat-epochs", type=int, default=None)
    args = parser.parse_args()
    defaults = {"digits": (12, 4), "fashion": (4, 2)}[args.data]
    t0 = time.perf_counter()
    results = run(args.data, args.fp32_epochs or defaults[0], args.qat_epochs or defaults[1])
    fp32 = results["fp32"]
    print("| model | test accuracy % | drop vs FP32 (points) |")
    print("|---|---|---|")
    for name, acc in results.items():
        print(f"| {name} | {acc:.2f} | {fp32 - acc:+.2f} |")
    ptq4 = results["w4a8_pof2 PTQ"]
    for name in ("w4a8_tqt_3sd QAT", "w4a8_tqt_ll_j QAT"):
        ok = fp32 - results[name] <= 1.0 and results[name] > ptq4
        print(f"{name}: within 1 point of FP32 and above W4A8 PTQ: {'met' if ok else 'MISSED'}")
    print(f"W8A8 PTQ within 0.5 points: {'met' if fp32 - results['w8a8_int8 PTQ'] <= 0.5 else 'MISSED'}")
    print(f"({time.perf_counter() - t0:.0f} s; data: {args.data})")


if __name__ == "__main__":
    main()
