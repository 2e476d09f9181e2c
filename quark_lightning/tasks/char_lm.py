"""Byte-level language model on Python's own standard library source: an offline corpus, a LLaMA-named transformer.

The corpus is the ``*.py`` files of the running interpreter's stdlib (no downloads); the model uses Hugging Face LLaMA
module names (``model.layers.N.self_attn.q_proj`` ...) so that GPTQ / AWQ code can address its layers by name.
Perplexity (exp of the mean token cross entropy over a whole split) is the headline metric.
"""

from __future__ import annotations

import functools
import math
import sysconfig
import zlib
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

SPLITS = ("train", "val", "test")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SEPARATOR = b"\n\n"


# --------------------------------------------------------------------------------------------------------------- data
def stdlib_root() -> Path:
    """The running interpreter's standard library directory: the corpus source, present on every Python install."""
    return Path(sysconfig.get_paths()["stdlib"])


def _split_of(crc: int) -> str:
    """Split of a file from the crc32 of its relative path: 1/20 test, 1/20 validation, the rest train."""
    bucket = crc % 20
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


def python_source_files(root: str | Path | None = None) -> list[tuple[str, Path]]:
    """(split, path) of every stdlib ``*.py`` file in crc32 order, so the corpus never depends on filesystem order."""
    base = Path(root) if root is not None else stdlib_root()
    keyed = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base)
        if _EXCLUDED_DIRS.intersection(rel.parts) or not path.is_file():
            continue
        name = rel.as_posix()
        keyed.append((zlib.crc32(name.encode("utf-8")), name, path))
    keyed.sort(key=lambda item: (item[0], item[1]))
    return [(_split_of(crc), path) for crc, _, path in keyed]


def _fill(paths: list[Path], budget: int | None) -> bytes:
    """Files joined with a blank line, read in order only until ``budget`` bytes are filled (None: all of them)."""
    chunks: list[bytes] = []
    size = 0
    for path in paths:
        if budget is not None and size >= budget:
            break
        data = path.read_bytes()
        if chunks:
            chunks.append(_SEPARATOR)
            size += len(_SEPARATOR)
        chunks.append(data)
        size += len(data)
    joined = b"".join(chunks)
    return joined if budget is None else joined[:budget]


@functools.lru_cache(maxsize=8)
def _corpus_bytes(
    root: str, train_bytes: int | None, val_bytes: int | None, test_bytes: int | None
) -> tuple[bytes, ...]:
    """The three splits as immutable bytes, cached: repeated setup() calls and tests do not re-read the files."""
    files = python_source_files(root)
    if not files:
        raise FileNotFoundError(f"no *.py files under the standard library directory {root!r}: the corpus is empty")
    budgets = {"train": train_bytes, "val": val_bytes, "test": test_bytes}
    return tuple(_fill([p for s, p in files if s == split], budgets[split]) for split in SPLITS)


def load_python_corpus(
    train_bytes: int | None = 1_000_000,
    val_bytes: int | None = 100_000,
    test_bytes: int | None = 100_000,
    root: str | Path | None = None,
) -> dict[str, torch.Tensor]:
    """{"train", "val", "test"}: int64 byte tokens (vocab 256) of the stdlib source, each split capped to its budget."""
    base = str(Path(root) if root is not None else stdlib_root())
    splits = _corpus_bytes(base, train_bytes, val_bytes, test_bytes)
    return {
        name: torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        for name, data in zip(SPLITS, splits, strict=True)
    }


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``): (x, y) with y = x shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class PythonSourceDataModule(L.LightningDataModule):
    """Byte windows of the stdlib source: shuffled (seeded) train loader, ordered val / test loaders."""

    vocab_size = 256

    def __init__(
        self,
        batch_size: int = 32,
        seq_len: int = 128,
        train_bytes: int | None = 1_000_000,
        val_bytes: int | None = 100_000,
        test_bytes: int | None = 100_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.train_bytes = train_bytes
        self.val_bytes = val_bytes
        self.test_bytes = test_bytes
        self.seed = seed
        self.corpus: dict[str, torch.Tensor] | None = None

    def setup(self, stage: str | None = None) -> None:
        """Read the corpus once (later calls for other stages reuse it) and cut it into windows."""
        if self.corpus is None:
            self.corpus = load_python_corpus(self.train_bytes, self.val_bytes, self.test_bytes)
            self.train_set, self.val_set, self.test_set = (TokenWindows(self.corpus[s], self.seq_len) for s in SPLITS)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)


# -------------------------------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    """Causal multi-head self-attention with LLaMA projection names (q/k/v/o_proj, no bias)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]; each position attends to itself and earlier positions only."""
        b, t, d = hidden_states.shape
        q, k, v = (
            proj(hidden_states).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """SwiGLU feed-forward, down(silu(gate(x)) * up(x)), with LLaMA names (gate/up/down_proj, no bias)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm LLaMA block: x + attn(norm(x)), then x + mlp(norm(x)); one tensor in, one tensor out."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(d_model, eps=eps)
        self.self_attn = Attention(d_model, n_heads)
        self.post_attention_layernorm = nn.RMSNorm(d_model, eps=eps)
        self.mlp = MLP(d_model, d_ff)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class CharBackbone(nn.Module):
    """The LLaMA ``model`` part: token + learned position embeddings, decoder layers, final RMSNorm."""

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int, max_seq_len: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.embed_positions = nn.Embedding(max_seq_len, d_model)
        self.layers = nn.ModuleList(DecoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d_model, eps=1e-5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.embed_positions.num_embeddings:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.embed_positions.num_embeddings}")
        positions = torch.arange(t, device=input_ids.device)
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class CharTransformer(nn.Module):
    """Byte-level decoder-only transformer named like HF LLaMA (``model.*`` + untied ``lm_head``) for GPTQ / AWQ."""

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        d_ff: int = 384,
        max_seq_len: int = 128,
    ) -> None:
        super().__init__()
        self.model = CharBackbone(vocab_size, d_model, n_layers, n_heads, d_ff, max_seq_len)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT / LLaMA style init: normal(0, 0.02) weights, zero biases (norms keep their ones)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 byte ids [B, T] (T <= max_seq_len) -> next-byte logits [B, T, vocab]."""
        return self.lm_head(self.model(input_ids))


# ---------------------------------------------------------------------------------------------------------- lightning
def warmup_cosine(step: int, warmup_steps: int, total_steps: float, floor: float = 0.1) -> float:
    """LR factor: linear warmup to 1 over ``warmup_steps``, then cosine decay to ``floor`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if not math.isfinite(total_steps):  # no known end (max_epochs=-1, no max_steps): constant after warmup
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1.0, total_steps - warmup_steps))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PerplexityLM(L.LightningModule):
    """The Lightning side of a next-token LM on (x, y) token batches: ``forward(x)`` gives logits [B, T, vocab];
    AdamW (warmup + cosine, hparams ``lr``, ``weight_decay``, ``warmup_steps``); logs loss and exact perplexity per
    split. Subclasses build the network and define ``forward``."""

    metrics = ("test_loss", "test_ppl")

    def __init__(self) -> None:
        super().__init__()
        self._loss_sum = torch.zeros((), dtype=torch.float64)
        self._token_count = torch.zeros((), dtype=torch.float64)

    def _token_losses(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Sum of the token cross entropies of a batch (in float32, whatever the precision) and its token count."""
        x, y = batch
        logits = self(x)
        loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        return loss_sum, y.numel()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss_sum, n = self._token_losses(batch)
        loss = loss_sum / n
        self.log("train_loss", loss, prog_bar=True)
        return loss

    # exact split perplexity: sums over every token of the epoch, reduced over ranks once at the end
    def _reset(self) -> None:
        """Zero the epoch's loss sum and token count (fresh for every validation / test epoch)."""
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._token_count = torch.zeros((), dtype=torch.float64, device=self.device)

    def _accumulate(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Add a batch's summed token loss and token count: batches of any size weigh by their tokens."""
        loss_sum, n = self._token_losses(batch)
        self._loss_sum = self._loss_sum.to(loss_sum.device) + loss_sum.detach().double()
        self._token_count = self._token_count.to(loss_sum.device) + n

    def _log_split(self, stage: str) -> None:
        """Log the split's mean token loss and its exp (perplexity), summed over ranks first under DDP."""
        loss_sum, count = self._loss_sum, self._token_count
        if self.trainer.world_size > 1:
            loss_sum = self.trainer.strategy.reduce(loss_sum.clone(), reduce_op="sum")
            count = self.trainer.strategy.reduce(count.clone(), reduce_op="sum")
        if float(count) == 0:
            return
        mean = loss_sum / count
        self.log(f"{stage}_loss", mean.float(), prog_bar=False)
        self.log(f"{stage}_ppl", torch.exp(mean).float(), prog_bar=stage == "val")

    def on_validation_epoch_start(self) -> None:
        self._reset()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._accumulate(batch)

    def on_validation_epoch_end(self) -> None:
        self._log_split("val")

    def on_test_epoch_start(self) -> None:
        self._reset()

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._accumulate(batch)

    def on_test_epoch_end(self) -> None:
        self._log_split("test")

    def configure_optimizers(self) -> dict:
        """AdamW (no decay on norm weights) with per-step linear warmup then cosine decay to 10% of lr."""
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
        )
        total = float(self.trainer.estimated_stepping_batches)
        schedule = functools.partial(warmup_cosine, warmup_steps=max(1, self.hparams.warmup_steps), total_steps=total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class CharLM(PerplexityLM):
    """CharTransformer trained with AdamW (warmup + cosine); logs loss and exact perplexity per split."""

    def __init__(
        self,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        d_ff: int = 384,
        max_seq_len: int = 128,
        warmup_steps: int = 50,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = CharTransformer(vocab_size, d_model, n_layers, n_heads, d_ff, max_seq_len)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of byte ids [B, T]: calibration feeds the x of (x, y) batches straight here."""
        return self.net(x)
