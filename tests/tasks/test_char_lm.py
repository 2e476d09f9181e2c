"""The byte-level LM task: stdlib corpus splits, windows, the LLaMA-named model and the exact perplexity metric."""

from __future__ import annotations

import math
import zlib

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.quantization.api import run_batch
from quark_lightning.tasks.char_lm import (
    CharLM,
    CharTransformer,
    PythonSourceDataModule,
    TokenWindows,
    load_python_corpus,
    python_source_files,
    stdlib_root,
    warmup_cosine,
)
from quark_lightning.tasks.lightning_digits import DigitsClassifier

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*number of training batches.*"),
]

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq_len": 16}


def _trainer(**kwargs) -> L.Trainer:
    """A quiet CPU trainer: no logger, checkpoints, progress bar or summary."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# ------------------------------------------------------------------------------------------------------------ corpus
def test_splits_are_deterministic_disjoint_and_follow_the_crc_rule() -> None:
    files = python_source_files()
    assert files == python_source_files()
    root = stdlib_root()
    paths = [p for _, p in files]
    assert len(paths) == len(set(paths)), "a file is listed twice (in two splits)"
    by_split = {s: {p for split, p in files if split == s} for s in ("train", "val", "test")}
    assert all(by_split.values()), "every split has files"
    assert not (by_split["train"] & by_split["val"] or by_split["train"] & by_split["test"])
    assert not by_split["val"] & by_split["test"]
    keys = []
    for split, path in files:
        rel = path.relative_to(root)
        assert not {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts)
        crc = zlib.crc32(rel.as_posix().encode())
        assert split == {0: "test", 1: "val"}.get(crc % 20, "train")
        keys.append((crc, rel.as_posix()))
    assert keys == sorted(keys), "files are in crc32 order, not filesystem order"


def test_corpus_budgets_tokens_and_order() -> None:
    corpus = load_python_corpus(train_bytes=5000, val_bytes=700, test_bytes=300)
    assert {k: len(v) for k, v in corpus.items()} == {"train": 5000, "val": 700, "test": 300}
    for tokens in corpus.values():
        assert tokens.dtype == torch.int64 and 0 <= int(tokens.min()) and int(tokens.max()) < 256
    # the splits start with their first file in crc order (files joined with a blank line)
    files = python_source_files()
    for split in ("train", "val", "test"):
        parts = [p.read_bytes() for s, p in files if s == split][:50]
        expected = b"\n\n".join(parts)[: len(corpus[split])]
        assert bytes(corpus[split].to(torch.uint8).tolist()) == expected
    again = load_python_corpus(train_bytes=5000, val_bytes=700, test_bytes=300)
    assert all(torch.equal(corpus[k], again[k]) for k in corpus)
    again["train"][0] = 0  # callers get their own tensors: the cache cannot be corrupted
    assert torch.equal(load_python_corpus(5000, 700, 300)["train"], corpus["train"])


def test_empty_stdlib_directory_raises(tmp_path) -> None:
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "pkg.py").write_text("x = 1\n")
    with pytest.raises(FileNotFoundError, match=r"no \*\.py files"):
        load_python_corpus(100, 100, 100, root=tmp_path)


# ------------------------------------------------------------------------------------------------------------- data
def test_windows_are_non_overlapping_and_targets_are_shifted_inputs() -> None:
    windows = TokenWindows(torch.arange(11), seq_len=3)
    assert len(windows) == 3  # tokens 0..9 used; token 10 would start an incomplete window
    x0, y0 = windows[0]
    assert x0.tolist() == [0, 1, 2] and y0.tolist() == [1, 2, 3]
    x2, y2 = windows[2]
    assert x2.tolist() == [6, 7, 8] and y2.tolist() == [7, 8, 9]
    for i in range(len(windows)):
        x, y = windows[i]
        assert x.shape == y.shape == (3,) and torch.equal(x[1:], y[:-1])
    with pytest.raises(IndexError):
        windows[3]
    assert len(TokenWindows(torch.arange(3), seq_len=3)) == 0


def test_datamodule_loaders() -> None:
    dm = PythonSourceDataModule(batch_size=4, seq_len=16, train_bytes=2000, val_bytes=500, test_bytes=500, seed=3)
    assert dm.vocab_size == 256
    dm.setup("fit")
    corpus = dm.corpus
    dm.setup("test")
    assert dm.corpus is corpus, "repeated setup reuses the loaded corpus"
    assert len(dm.train_set) == (2000 - 1) // 16 and len(dm.val_set) == (500 - 1) // 16

    def first_inputs(loader):
        return torch.cat([x for x, _ in loader])

    assert torch.equal(first_inputs(dm.train_dataloader()), first_inputs(dm.train_dataloader())), "seeded shuffle"
    ordered = torch.stack([dm.train_set[i][0] for i in range(len(dm.train_set))])
    assert not torch.equal(first_inputs(dm.train_dataloader()), ordered), "train loader is shuffled"
    val = next(iter(dm.val_dataloader()))
    assert torch.equal(val[0], torch.stack([dm.val_set[i][0] for i in range(4)])), "val loader is in order"
    x, y = next(iter(dm.test_dataloader()))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64


# ------------------------------------------------------------------------------------------------------------ model
def test_model_shapes_names_and_group_friendly_linears() -> None:
    net = CharTransformer()
    logits = net(torch.randint(0, 256, (2, 128)))
    assert logits.shape == (2, 128, 256)
    names = dict(net.named_modules())
    for name in (
        "model.embed_tokens",
        "model.embed_positions",
        "model.layers.0.input_layernorm",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.post_attention_layernorm",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.3.mlp.down_proj",
        "model.norm",
        "lm_head",
    ):
        assert name in names, name
    assert isinstance(names["model.layers.0.input_layernorm"], nn.RMSNorm)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 4 * 7 + 1
    assert all(m.bias is None and m.in_features % 32 == 0 for m in linears)
    assert net.lm_head.weight.data_ptr() != net.model.embed_tokens.weight.data_ptr(), "untied head"
    layer = net.model.layers[0]
    h = torch.randn(2, 5, 128)
    assert layer(h).shape == h.shape
    with pytest.raises(ValueError, match="max_seq_len"):
        net(torch.zeros(1, 129, dtype=torch.int64))


def test_model_is_causal() -> None:
    torch.manual_seed(0)
    net = CharTransformer(**TINY).eval()
    x = torch.randint(0, 256, (2, 16))
    t = 9
    changed = x.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        a, b = net(x), net(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_lightning_module_runs_on_calibration_tuples() -> None:
    model = CharLM(**TINY)
    x = torch.randint(0, 256, (3, 16))
    assert run_batch(model, (x, x)).shape == (3, 16, 256)
    assert CharLM.metrics == ("test_loss", "test_ppl") and DigitsClassifier.metrics == ("test_loss", "test_acc")
    assert model.hparams.d_model == 32 and model.hparams.warmup_steps == 50


# ------------------------------------------------------------------------------------------------------- perplexity
@pytest.mark.parametrize("stage", ["validate", "test"])
def test_perplexity_is_exp_of_the_mean_token_loss_over_the_split(stage: str) -> None:
    torch.manual_seed(0)
    # 800 val / test bytes, seq_len 16 -> 49 windows; batch 8 -> 6 full batches and one batch of 1
    dm = PythonSourceDataModule(batch_size=8, seq_len=16, train_bytes=1000, val_bytes=800, test_bytes=800)
    model = CharLM(**TINY)
    with torch.no_grad():  # confident, varied predictions: token losses differ a lot between batches
        nn.init.normal_(model.net.lm_head.weight, std=1.0)
    trainer = _trainer()
    prefix = "val" if stage == "validate" else "test"
    (result,) = getattr(trainer, stage)(model, datamodule=dm, verbose=False)
    loader = dm.val_dataloader() if stage == "validate" else dm.test_dataloader()
    sizes = [len(x) for x, _ in loader]
    assert sizes[-1] < sizes[0], "the check needs a smaller last batch"
    model.eval()
    with torch.no_grad():
        logits, targets = zip(*[(model(x), y) for x, y in loader], strict=True)
        per_batch = [
            F.cross_entropy(lo.reshape(-1, 256), t.reshape(-1)).item() for lo, t in zip(logits, targets, strict=True)
        ]
        token_mean = F.cross_entropy(torch.cat(logits).reshape(-1, 256), torch.cat(targets).reshape(-1)).item()
    assert result[f"{prefix}_loss"] == pytest.approx(token_mean, rel=1e-5)
    assert result[f"{prefix}_ppl"] == pytest.approx(math.exp(token_mean), rel=1e-5)
    # averaging per-batch means weights the small last batch too much: not what is logged
    batch_mean = sum(per_batch) / len(per_batch)
    assert abs(batch_mean - token_mean) > 1e-4
    # a second evaluation starts from zero again (sums are reset at epoch start)
    (again,) = getattr(trainer, stage)(model, datamodule=dm, verbose=False)
    assert again[f"{prefix}_ppl"] == pytest.approx(result[f"{prefix}_ppl"], rel=1e-6)


def test_warmup_cosine_schedule() -> None:
    assert warmup_cosine(0, 10, 100) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 100) == pytest.approx(1.0)
    assert warmup_cosine(10, 10, 100) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100) == pytest.approx(0.55)
    assert warmup_cosine(100, 10, 100) == pytest.approx(0.1)
    assert warmup_cosine(500, 10, 100) == pytest.approx(0.1)
    assert warmup_cosine(500, 10, float("inf")) == 1.0


def test_a_few_training_steps_lower_the_loss() -> None:
    torch.manual_seed(0)
    dm = PythonSourceDataModule(batch_size=8, seq_len=16, train_bytes=4000, val_bytes=600, test_bytes=600)
    model = CharLM(lr=1e-2, warmup_steps=2, **TINY)
    trainer = _trainer(max_steps=25, num_sanity_val_steps=0, limit_val_batches=0)
    (before,) = trainer.test(model, datamodule=dm, verbose=False)
    trainer.fit(model, datamodule=dm)
    (after,) = trainer.test(model, datamodule=dm, verbose=False)
    assert trainer.global_step == 25
    assert after["test_loss"] < before["test_loss"] - 0.5
    assert before["test_ppl"] == pytest.approx(math.exp(before["test_loss"]), rel=1e-5)
    lrs = trainer.lr_scheduler_configs[0]
    assert lrs.interval == "step"
