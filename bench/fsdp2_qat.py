"""FSDP2 QAT against DDP QAT and against FSDP2 without quantization: 2 ranks on CPU (gloo), a tiny LLaMA.

Four runs of the same model (a random ``LlamaForCausalLM``, ``--layers`` decoder layers of width ``--hidden``), the
same data (a fixed-seed Markov-chain token stream, so the loss has something to learn; Lightning's distributed
sampler gives each rank its half) and the same seed, ``--steps`` AdamW steps each:

- ``fsdp2``: ``ModelParallelStrategy`` with ``fully_shard`` per decoder layer + root, no quantization;
- ``fsdp2-qat``: the same with ``QuantCallback`` (int8 TQT weights, learned log2 thresholds with ``quantizer_lr``,
  int8 per-tensor min-max activations fixed after ``--observer-steps`` batches);
- ``ddp-qat``: the same QAT under ``strategy="ddp"`` (a full replica per rank);
- ``ddp``: DDP without quantization (the memory peer of ``fsdp2``).

Printed, as ratios of peers measured in this run:

- per-rank parameter + optimizer bytes: the rank's local parameter tensors (FSDP2: its shards) plus its optimizer
  state tensors, counted after training, FSDP2-QAT / DDP-QAT and FSDP2 / DDP (about 0.5 is the goal);
- step time: the median over the steps after ``--warmup`` of rank 0's ``on_train_batch_start`` -> ``_end`` (forward,
  backward, optimizer step), FSDP2-QAT / FSDP2 in the same round (``--rounds`` rounds in one launch of the two
  processes, the order alternating; the median ratio and each round's are printed; at most 1.3 is the goal);
- perplexity on ``--eval-batches`` held-out batches after training (eval mode, the quantized model for the QAT runs),
  FSDP2-QAT against DDP-QAT (equal within noise: the same updates, up to the order of float sums).

Each launch is a subprocess (this script with ``--run NAME``, which Lightning relaunches for rank 1). The machine this
was measured on: 2 shared CPU cores (other jobs ran beside it); ``OMP_NUM_THREADS=1`` per rank.

    python bench/fsdp2_qat.py                   # about 5 minutes on 2 shared cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

LAUNCHES = ("fsdp2-pair", "ddp-qat", "ddp")  # one launch of the two processes each
TQT = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "scale_type": "pof2",
    "round_method": "half_even",
    "is_dynamic": False,
    "qat_spec": {"method": "tqt", "threshold_init_meth": "_3SD"},
}


def markov_tokens(n: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """``n`` sequences of a fixed random Markov chain (each token has 4 likely successors)."""
    g = torch.Generator().manual_seed(1234)  # the chain: the same for training and held-out data
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, seq, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, seq):
        pick = torch.randint(0, 4, (n,), generator=g)
        out[:, t] = successors[out[:, t - 1], pick]
    return out


class LitLlama(LightningModule):
    """A random LLaMA; ``configure_model`` shards each decoder layer and the root under ModelParallelStrategy."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 8 // 3,
            num_hidden_layers=args.layers,
            num_attention_heads=max(1, args.hidden // 64),
            num_key_value_heads=max(1, args.hidden // 64),
            max_position_embeddings=args.seq,
        )
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.lr = args.lr

    def configure_model(self) -> None:
        if self._device_mesh is None:  # DDP: nothing to shard
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (its shard for a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class Measure(Callback):
    """Rank 0's step times; after training, the rank's parameter + optimizer bytes and the held-out perplexity."""

    def __init__(self, held_out: torch.Tensor, batch: int) -> None:
        self.held_out, self.batch = held_out, batch
        self.times: list[float] = []
        self.result: dict[str, Any] = {}
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._t0)

    @torch.no_grad()
    def on_train_end(self, trainer, pl_module) -> None:
        params = sum(local_bytes(p) for p in pl_module.parameters())
        optim = sum(
            local_bytes(v)
            for opt in trainer.optimizers
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        was_training = pl_module.training
        pl_module.eval()
        losses = []
        for i in range(0, len(self.held_out), self.batch):
            ids = self.held_out[i : i + self.batch]
            logits = pl_module.model(input_ids=ids).logits
            losses.append(float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))))
        pl_module.train(was_training)
        self.result = {"param_bytes": params, "optim_bytes": optim, "ppl": math.exp(statistics.fmean(losses))}


def fit_once(name: str, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """One fit of run ``name`` (both ranks); this rank's (rank, result)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from callbacks.quant import QuantCallback
    from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT

    torch.manual_seed(0)
    train = markov_tokens(args.samples, args.seq, args.vocab, seed=1)
    held_out = markov_tokens(args.eval_batches * args.batch, args.seq, args.vocab, seed=2)
    measure = Measure(held_out, args.batch)
    callbacks: list[Callback] = [measure]
    if name.endswith("-qat"):
        config = {"global_quant_config": {"weight": TQT, "input_tensors": INT8_PER_TENSOR_ACT}}
        callbacks.append(
            QuantCallback(config, mode="qat", observer_steps=args.observer_steps, quantizer_lr=1e-2, log_sqnr=False)
        )
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if name.startswith("fsdp2") else "ddp"
    )
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    trainer.fit(LitLlama(args), DataLoader(TensorDataset(train), batch_size=args.batch, shuffle=False))
    return trainer.global_rank, {**measure.result, "step_s": statistics.median(measure.times[args.warmup :])}


def run(name: str, args: argparse.Namespace) -> None:
    """One launch of the two processes: ``fsdp2-pair`` fits FSDP2 and FSDP2-QAT in ``--rounds`` rounds (the order
    alternating, so drift of the shared machine hits both), the others one fit. Writes ``<out>/<name>_rank<r>.json``:
    ``{run: [result per round]}``."""
    names = ("fsdp2", "fsdp2-qat") if name == "fsdp2-pair" else (name,)
    rounds = args.rounds if name == "fsdp2-pair" else 1
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    rank = 0
    for r in range(rounds):
        for each in names if r % 2 == 0 else reversed(names):
            rank, result = fit_once(each, args)
            results[each].append(result)
    Path(args.out, f"{name}_rank{rank}.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", choices=LAUNCHES, help="internal: one launch (both ranks)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench_fsdp2_out")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--observer-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=8)
    args = parser.parse_args()
    args.samples = args.steps * args.batch * 2
    if args.run:
        run(args.run, args)
        return
    os.makedirs(args.out, exist_ok=True)
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(root), env.get("PYTHONPATH", "")]))
    results: dict[str, list[list[dict[str, Any]]]] = {}  # run -> rank -> rounds
    for launch in LAUNCHES:
        argv = [sys.executable, __file__, "--run", launch, *sys.argv[1:]]
        done = subprocess.run(argv, cwd=str(root), env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{launch} failed:\n{done.stderr[-6000:]}")
        per_rank = [json.loads(Path(args.out, f"{launch}_rank{r}.json").read_text()) for r in (0, 1)]
        for name in per_rank[0]:
            results[name] = [per_rank[0][name], per_rank[1][name]]
    print(
        f"2 ranks (gloo) on 2 shared CPU cores, OMP_NUM_THREADS=1 per rank; LLaMA {args.layers}x{args.hidden}, "
        f"vocab {args.vocab}, {args.steps} steps of {args.batch}x{args.seq} tokens per rank; FSDP2 and FSDP2-QAT in "
        f"{args.rounds} alternating rounds in one launch, DDP runs once each"
    )
    print(f"{'run':10} {'params+optim B/rank':>20} {'step ms (median of rounds)':>27} {'ppl':>9}")
    for name, (r0, _) in results.items():
        step = statistics.median(x["step_s"] for x in r0)
        print(f"{name:10} {r0[0]['param_bytes'] + r0[0]['optim_bytes']:>20,} {1e3 * step:>27.1f} {r0[0]['ppl']:>9.3f}")

    def mem(name: str) -> int:
        return max(r[0]["param_bytes"] + r[0]["optim_bytes"] for r in results[name])

    print(f"per-rank params+optimizer, FSDP2-QAT / DDP-QAT: {mem('fsdp2-qat') / mem('ddp-qat'):.3f}  (goal ~0.5)")
    print(f"per-rank params+optimizer, FSDP2 / DDP:         {mem('fsdp2') / mem('ddp'):.3f}")
    ratios = sorted(
        q["step_s"] / f["step_s"] for q, f in zip(results["fsdp2-qat"][0], results["fsdp2"][0], strict=True)
    )
    print(
        f"step time, FSDP2-QAT / FSDP2 (same round):     {statistics.median(ratios):.3f}  "
        f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}; goal <= 1.3)"
    )
    ppl_f, ppl_d = results["fsdp2-qat"][0][0]["ppl"], results["ddp-qat"][0][0]["ppl"]
    print(
        f"perplexity, FSDP2-QAT / DDP-QAT:               {ppl_f / ppl_d:.5f}  ({ppl_f:.4f} vs {ppl_d:.4f}; "
        f"float FSDP2 {results['fsdp2'][0][0]['ppl']:.4f}, DDP {results['ddp'][0][0]['ppl']:.4f})"
    )


if __name__ == "__main__":
    main()
