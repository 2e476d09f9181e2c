"""A Hugging Face causal LM (``AutoModelForCausalLM``, LLaMA by default) on Python's standard library source.

The model is built from a config (``conf/model/hf_llama.yaml``: LlamaConfig fields, random weights) or loaded from a
local directory written by ``save_pretrained`` (``pretrained=<dir>``; no hub downloads). The corpus is the one of
``experiment=char_lm`` (``quark_lightning.tasks.char_lm``): the text is cut into the same splits and byte budgets, then tokenized by
the directory's own tokenizer when it has one, or read as bytes (ids 0..255; the built-in config reserves 256 / 257
for BOS / EOS). Perplexity per token of that tokenization is the headline metric; with bytes it is the same number
``experiment=char_lm`` reports, on the same test bytes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from quark.torch.extras import import_extra
from quark_lightning.tasks.char_lm import SPLITS, PerplexityLM, PythonSourceDataModule, TokenWindows, load_python_corpus

#: files of which one marks a directory that holds a tokenizer (fast, sentencepiece, or BPE vocab + merges)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)
BYTE_VOCAB = 256


def _transformers() -> Any:
    return import_extra("transformers", "hf", "experiment=hf_lm")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def _local_dir(path: str | Path, what: str) -> Path:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"{what} {str(path)!r} is not a directory (a local save_pretrained directory; nothing is downloaded)"
        )
    return root


# --------------------------------------------------------------------------------------------------------------- data
def has_tokenizer(path: str | Path | None) -> bool:
    """Whether the directory ``path`` holds tokenizer files (False for None)."""
    return path is not None and any((Path(path).expanduser() / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path | None) -> Any | None:
    """``AutoTokenizer`` of a local directory, or None when ``path`` is None or the directory has no tokenizer
    files (byte-level tokens then). Tokenizer files that do not load are an error, never a silent fallback."""
    if path is None:
        return None
    root = _local_dir(path, "data.tokenizer (experiment=hf_lm: model.pretrained's)")
    if not has_tokenizer(root):
        return None
    transformers = _transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"data.tokenizer={str(path)!r} has tokenizer files that AutoTokenizer cannot load: {err}"
        ) from err


def _encode(tokenizer: Any, data: bytes) -> torch.Tensor:
    """Token ids of ``data`` (UTF-8 text; a code point cut by the byte budget becomes U+FFFD), line by line so
    that no call exceeds the tokenizer's model_max_length warning; no special tokens are added."""
    lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
    ids: list[int] = []
    for start in range(0, len(lines), 4096):
        for row in tokenizer(lines[start : start + 4096], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
    return torch.tensor(ids, dtype=torch.long)


@functools.lru_cache(maxsize=4)
def _tokenized_corpus(
    tokenizer_dir: str, train_bytes: int | None, val_bytes: int | None, test_bytes: int | None
) -> tuple[torch.Tensor, ...]:
    tokenizer = load_tokenizer(tokenizer_dir)
    byte_splits = load_python_corpus(train_bytes, val_bytes, test_bytes)
    return tuple(_encode(tokenizer, bytes(byte_splits[s].to(torch.uint8).numpy())) for s in SPLITS)


class HFPythonSourceDataModule(PythonSourceDataModule):
    """The stdlib-source windows of ``PythonSourceDataModule``, as bytes or as the tokens of the tokenizer found in
    the local directory ``tokenizer`` (``experiment=hf_lm`` passes ``model.pretrained``). ``vocab_size``: 256 for
    bytes, else the tokenizer's size with its added tokens."""

    def __init__(
        self,
        batch_size: int = 32,
        seq_len: int = 128,
        train_bytes: int | None = 1_000_000,
        val_bytes: int | None = 100_000,
        test_bytes: int | None = 100_000,
        seed: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__(batch_size, seq_len, train_bytes, val_bytes, test_bytes, seed)
        self.tokenizer = load_tokenizer(tokenizer)
        self.tokenizer_dir = str(Path(tokenizer).expanduser().resolve()) if self.tokenizer is not None else None
        self.vocab_size = BYTE_VOCAB if self.tokenizer is None else len(self.tokenizer)

    def setup(self, stage: str | None = None) -> None:
        if self.corpus is not None:
            return
        if self.tokenizer is None:
            self.corpus = load_python_corpus(self.train_bytes, self.val_bytes, self.test_bytes)
        else:
            splits = _tokenized_corpus(self.tokenizer_dir, self.train_bytes, self.val_bytes, self.test_bytes)
            self.corpus = dict(zip(SPLITS, splits, strict=True))
        self.train_set, self.val_set, self.test_set = (TokenWindows(self.corpus[s], self.seq_len) for s in SPLITS)


# -------------------------------------------------------------------------------------------------------------- model
def build_causal_lm(
    config: dict[str, Any] | None, pretrained: str | None, attn_implementation: str | None = "sdpa"
) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(pretrained)`` (a local directory, float32) or, when ``pretrained`` is
    None, ``from_config`` of ``config`` (its ``model_type`` picks the architecture; random weights)."""
    transformers = _transformers()
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if pretrained is not None:
        root = _local_dir(pretrained, "model.pretrained")
        if not (root / "config.json").is_file():
            raise FileNotFoundError(
                f"model.pretrained={str(pretrained)!r} has no config.json (written by save_pretrained?)"
            )
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(root), dtype=torch.float32, local_files_only=True, **kwargs
        )
    else:
        fields = dict(config or {})
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.config needs model_type (e.g. llama) when model.pretrained is null")
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **fields)
        except ValueError as err:
            raise ValueError(f"model.config: {err}") from None
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **kwargs)
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]  # what save_pretrained writes: a complete config.json
    return model.train()  # from_pretrained returns it in eval mode; Lightning switches modes per stage from here


class HFCausalLM(PerplexityLM):
    """A Hugging Face causal LM (``self.net``) trained and evaluated as ``quark_lightning.tasks.char_lm.CharLM`` is: AdamW with
    warmup + cosine, exact per-split perplexity. ``export=[quark]`` writes ``self.net`` (``export_module``) as a
    Hugging Face directory with a Quark ``quantization_config``."""

    export_module = "net"

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        attn_implementation: str | None = "sdpa",
    ) -> None:
        super().__init__()
        config = _plain(config)
        self.save_hyperparameters()
        self.net = build_causal_lm(config, pretrained, attn_implementation)
        self.hf_config = self.net.config  # kept: graph mode (quant_mode=fx_graph_mode) replaces ``net`` by its graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of token ids [B, T] (no KV cache: every call sees whole windows)."""
        return self.net(input_ids=x, use_cache=False).logits

    def check_datamodule(self, datamodule: Any) -> None:
        """The data fits the model: token ids below its vocab_size, windows within its positions (ValueError)."""
        config = self.hf_config
        vocab = getattr(datamodule, "vocab_size", None)
        if vocab is not None and vocab > config.vocab_size:
            source = "its tokenizer" if getattr(datamodule, "tokenizer", None) is not None else "byte-level tokens"
            raise ValueError(
                f"the data's vocabulary ({source}: {vocab} ids) exceeds the model's vocab_size {config.vocab_size}; "
                "byte-level data needs vocab_size >= 256 (the model's own tokenizer is used when model.pretrained holds one)"
            )
        seq_len = getattr(datamodule, "seq_len", None)
        positions = getattr(config, "max_position_embeddings", None)
        if seq_len is not None and positions is not None and seq_len > positions:
            raise ValueError(f"data.seq_len={seq_len} exceeds the model's max_position_embeddings={positions}")

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None:
            self.check_datamodule(datamodule)
