"""AWQ (Lin et al. 2023): protect the weights that meet large activations, then clip the weights' ranges.

Per decoder layer, for every scaling group (``prev_op`` -> ``layers`` reading input ``inp``; optionally a
``module2inspect`` whose output is compared), in order:

* Scale search: ``s = mean|x|^ratio`` per input channel (``x`` the calibration inputs of ``inp``), normalised by
  ``sqrt(max(s) * min(s))``, for ``ratio = i / N_GRID``, ``i = 0 .. N_GRID - 1``. Each candidate quantizes the group's
  weights as ``rtn(W * s) / s`` (round-to-nearest with the qparams of the layer's own weight spec and observer) and
  is scored by the squared error of the output against the float output on every calibration token: the output of
  ``module2inspect`` when given (the other weights of that module stay float), else the layers' own outputs. The
  lowest error wins; ratio 0 (``s = 1``, plain RTN) is a candidate, so the result is never worse than RTN on the
  calibration data. ``s`` is folded into ``prev_op`` (its output channels divided, bias too; a ``(1 + w)`` norm as
  ``smoothquant.fold_scales`` says) and into the layers (input channels multiplied): the float function does not
  change (a fused producer: only the rows that feed the layers, ``fused_rows``). That is checked once all groups
  are folded, before clipping: the layer's output on its calibration calls must be the one before to float noise
  (``quark.torch.quantization.equivalence``), else EquivalenceError names AWQ and the layer.
* Clipping search, once all groups are scaled, for every weight-quantized linear with integer per-channel or
  per-group weights except those producing attention queries or keys (``_NO_CLIP``). The candidates per output row
  and input group are the ranges ``max|w| * (1 - i / CLIP_GRID)``, ``i = 0 .. CLIP_STEPS - 1`` (1.0 .. 0.55 of the
  original; 1.0 is no clipping). First each (row, group) takes the candidate with the least squared error of its
  partial output ``x_g . (rtn(clamp(w_g)) - w_g)`` over the calibration tokens (their inputs after scaling), as in
  AWQ; then up to ``CLIP_SWEEPS`` sweeps of coordinate descent on the error of the whole row's output
  ``(x . (rtn(clamp(w)) - w))^2``, cross-group terms included: group after group, each row moves to the candidate
  that lowers it most given its other groups (a sweep that changes nothing ends it). That never raises a row's
  output error on the calibration tokens above the per-group choice. The weight is clamped to the result.

amd-quark's ``AwqProcessor`` (0.13) makes the same choices for the scale (the grid of 20 ratios on the mean absolute
input, no weight term, MSE on ``module2inspect``'s output, everything in the model's dtype) and the same candidates
for clipping (``n_grid`` 20, ``max_shrink`` 0.5: 10 candidates; q/k not clipped). Ours differs in:

* the clipping objective: amd-quark stops at the per-group choice, on a strided sample of about 512 calibration
  tokens; ours uses every token, and the row-wise sweeps above (on LLaMA-style models they lower the held-out error
  further: ``bench/awq_speed.py``).
* how the errors are computed, not what they are: one pass of the layer collects everything (amd-quark: the same):
  each ``inp``'s mean |x|; the calls each ``module2inspect`` receives; for groups without ``module2inspect`` and for
  every clipped linear the Gram matrix ``H = X^T X`` of its inputs, so that a weight change ``dW`` costs
  ``tr(dW H dW^T)`` (no pass over the tokens, whatever their number; the inputs themselves are kept instead when
  there are fewer tokens than input features). Memory: ``in^2`` floats per such linear, and the clipping candidates
  ``CLIP_STEPS`` times its weight. Later folds change these inputs only by a known scale, which the statistics take
  exactly; a group whose ``inp``, layers or ``prev_op`` an earlier group already rescaled is collected again.
* the decoder layer's calibration calls that differ only along the batch dimension (same shapes; other arguments
  equal or batched alike: dim 0 the call's batch size, or a multiple of it as Bloom's alibi, [batch * heads, ...])
  run as one call of up to ``MERGE_TOKENS`` tokens (amd-quark concatenates them all); the merge is checked against
  separate calls on a first pair, and dropped if the outputs differ or the merged call fails.
* the next decoder layer's calibration inputs are this layer's outputs after AWQ (scaled and clipped, still float:
  ``api._per_decoder_layer``); amd-quark feeds the float layer's outputs from before AWQ.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from quark.torch.algorithm.capture import LayerInputs, capture_calls, check_layer_kept, collect_inputs, hidden_of
from quark.torch.algorithm.fused_rows import producer_rows, tie_scales
from quark.torch.algorithm.gptq import observer_qparams
from quark.torch.algorithm.smoothquant import fold_scales
from quark.torch.algorithm.structure import ScalingGroup, scaling_groups
from quark.torch.quantization.config.config import AWQConfig, QuantizationSpec
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.hf import is_linear, linear_weight
from quark.torch.quantization.nn.modules.linear_parts import named_modules_with_parts
from quark.torch.quantization.tensor_quantize import apply_format

N_GRID = 20  # scale ratios i / N_GRID, i = 0 .. N_GRID - 1
CLIP_GRID = 20  # clipping ranges 1 - i / CLIP_GRID of the max ...
CLIP_STEPS = 10  # ... for i = 0 .. CLIP_STEPS - 1
CLIP_SWEEPS = 3  # sweeps of row-wise coordinate descent after the per-group clipping choice (0: none)
MERGE_TOKENS = 16384  # tokens per merged decoder-layer call
#: layers producing attention queries or keys (alone or fused): attention logits are sensitive to clipping them
_NO_CLIP = ("q_proj", "k_proj", "query", "key", "Wqkv", "qkv_proj", "c_attn", "query_key_value", "q_lin", "k_lin")


def rtn(weight: torch.Tensor, spec: QuantizationSpec | None) -> torch.Tensor:
    """Round-to-nearest fake quantization of ``weight`` with qparams from the spec's own observer."""
    if spec is None:
        return weight
    scale = zero_point = None
    if spec.observer_cls is not None and getattr(spec.observer_cls, "__name__", "") not in ("PlaceholderObserver",):
        scale, zero_point = observer_qparams(spec, weight)
    return apply_format(weight, spec, scale, zero_point)


# ----------------------------------------------------------------------------------------------- input statistics
T = TypeVar("T")


def _collected(value: T | None, what: str) -> T:
    """``value``, or a RuntimeError naming the statistic AWQ needs and a module's calibration did not collect (no
    calibration token reached it, or its statistics were set up without that one)."""
    if value is None:
        raise RuntimeError(
            f"AWQ: no {what} for a layer it searches: no calibration input reached it, or its statistics were "
            "set up without it"
        )
    return value


@dataclass
class _InputStats:
    """What one module's calibration inputs are needed for: mean |x| per channel, and the squared output error of a
    weight change ``dW`` without the inputs themselves (from their Gram matrix, or from the inputs when fewer)."""

    features: int
    want_gram: bool = False  # the full Gram matrix X^T X
    want_rows: bool = False  # the inputs themselves
    block: int | None = None  # the diagonal blocks of the Gram matrix (from the full one if wanted)
    tokens: int = 0
    abs_sum: torch.Tensor | None = None
    gram: torch.Tensor | None = None
    rows: list[torch.Tensor] = field(default_factory=list)
    _blocks: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if not x.shape[0]:
            return
        self.tokens += x.shape[0]
        total = x.abs().sum(dim=0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        if self.want_rows:
            self.rows.append(x)
        if self.want_gram:
            gram = x.T @ x
            self.gram = gram if self.gram is None else self.gram + gram
        elif self.block is not None:
            xg = x.reshape(x.shape[0], -1, self.block).transpose(0, 1)  # [groups, tokens, block]
            blocks = xg.transpose(1, 2) @ xg
            self._blocks = blocks if self._blocks is None else self._blocks + blocks

    @property
    def blocks(self) -> torch.Tensor:
        """[groups, block, block]: the Gram matrix of each group of input features."""
        if self.gram is not None and self.block is not None:
            n = self.features // self.block
            idx = torch.arange(n, device=self.gram.device)
            return self.gram.reshape(n, self.block, n, self.block)[idx, :, idx, :]
        return _collected(self._blocks, "Gram blocks of its inputs")

    def mean_abs(self) -> torch.Tensor:
        return _collected(self.abs_sum, "mean |x| of its inputs") / self.tokens

    def output_error(self, delta: torch.Tensor) -> float:
        """Sum over tokens and outputs of ``(x . delta_row)^2`` for a weight change ``delta`` [out, in]."""
        if self.rows:
            return sum(float((x @ delta.T).pow(2).sum()) for x in self.rows)
        gram = _collected(self.gram, "Gram matrix of its inputs")
        return float(((delta @ gram) * delta).sum())

    def rescale(self, s: torch.Tensor) -> None:
        """The statistics of ``x / s`` (a scale folded into the producer of these inputs)."""
        if self.abs_sum is not None:
            self.abs_sum = self.abs_sum / s
        self.rows = [x / s for x in self.rows]
        if self.gram is not None:
            self.gram = self.gram / s.reshape(-1, 1) / s.reshape(1, -1)
        if self._blocks is not None and self.block is not None:
            sb = s.reshape(-1, self.block)
            self._blocks = self._blocks / sb.unsqueeze(2) / sb.unsqueeze(1)


def _collect(
    layer: nn.Module, calls: LayerInputs, stats: dict[str, _InputStats], inspect: dict[str, nn.Module]
) -> tuple[dict[str, LayerInputs], list[torch.Tensor]]:
    """One pass of ``layer`` over ``calls``: the inputs of the modules named in ``stats`` into their statistics, the
    calls each module of ``inspect`` receives, and the layer's outputs (what the folds must keep)."""
    modules = dict(named_modules_with_parts(layer))
    with ExitStack() as stack, torch.no_grad():
        stack.enter_context(collect_inputs({n: modules[n] for n in stats}, lambda n, m, x: stats[n].add(x)))
        captured = {n: stack.enter_context(capture_calls(m)) for n, m in inspect.items()}
        outputs = [hidden_of(layer(*args, **kwargs)) for args, kwargs in calls]
    return captured, outputs


# ----------------------------------------------------------------------------------------------- merged calls
def _batch_of(call: tuple[tuple[Any, ...], dict[str, Any]]) -> torch.Tensor | None:
    """The hidden states of a layer call (first positional argument or ``hidden_states=``), if a batched tensor."""
    args, kwargs = call
    hidden = args[0] if args else kwargs.get("hidden_states")
    return hidden if isinstance(hidden, torch.Tensor) and hidden.ndim >= 2 else None


def _per_sample(value: torch.Tensor, batch: int) -> int | None:
    """How many rows of dim 0 ``value`` has per sample of a call of ``batch`` samples (1 for most batched tensors,
    the number of heads for Bloom's alibi [batch * heads, 1, keys]); None when dim 0 is not a multiple of ``batch``
    or ``value`` is 1-D (``cache_position``: per token, never per sample)."""
    if value.ndim < 2 or batch < 1 or value.shape[0] % batch:
        return None
    return value.shape[0] // batch


def _batched_alike(values: list[torch.Tensor], batches: list[int]) -> bool:
    """Whether ``values`` (one per call) are per sample of their calls alike: the same rows per sample along dim 0
    (sample-major, so they concatenate along it) and the same shape otherwise."""
    rows = [_per_sample(v, b) for v, b in zip(values, batches, strict=True)]
    first = values[0]
    return (
        rows[0] is not None
        and all(r == rows[0] for r in rows)
        and all(v.ndim == first.ndim and v.shape[1:] == first.shape[1:] for v in values)
    )


def _fits(a: Any, b: Any, batch_a: int, batch_b: int) -> bool:
    """Whether a call's argument ``b`` can merge with ``a`` of another: tensors batched alike along dim 0
    (concatenated) or equal (kept once), containers of such, other values equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
            return False
        return _batched_alike([a, b], [batch_a, batch_b]) or a is b or (a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, tuple | list):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_fits(x, y, batch_a, batch_b) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_fits(a[k], b[k], batch_a, batch_b) for k in a)
    return a is b or (type(a) is type(b) and bool(a == b))


def _merge_values(values: list[Any], batches: list[int]) -> Any:
    """One value for all calls: tensors concatenated along dim 0 when they are batched alike (``_batched_alike``),
    else the first when all are equal; ValueError when neither."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if _batched_alike(values, batches):
            return torch.cat(values)
        if all(v is first or torch.equal(v, first) for v in values):
            return first
        raise ValueError("arguments that neither concatenate nor agree")
    if isinstance(first, tuple | list):
        return type(first)(_merge_values([v[i] for v in values], batches) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _merge_values([v[k] for v in values], batches) for k in first}
    return first


def _merge(calls: LayerInputs) -> LayerInputs:
    """Consecutive calls that fit (``_fits``) merged along the batch dimension, up to ``MERGE_TOKENS`` tokens each."""
    merged: LayerInputs = []
    run: LayerInputs = []
    batches: list[int] = []
    tokens = 0

    def flush() -> None:
        if len(run) > 1:
            try:
                merged.append(_merge_values(list(run), batches))
            except ValueError:
                merged.extend(run)
        else:
            merged.extend(run)
        run.clear()
        batches.clear()

    for call in calls:
        hidden = _batch_of(call)
        if hidden is None:
            flush()
            merged.append(call)
            tokens = 0
            continue
        n = hidden.numel() // hidden.shape[-1]
        if run and (tokens + n > MERGE_TOKENS or not _fits(run[0], call, batches[0], hidden.shape[0])):
            flush()
            tokens = 0
        run.append(call)
        batches.append(hidden.shape[0])
        tokens += n
    flush()
    return merged


def _merged_calls(layer: nn.Module, calls: LayerInputs) -> LayerInputs:
    """``calls`` merged (see ``_merge``) if the layer's output on a merged pair of them is its outputs on the two."""
    merged = _merge(calls)
    if len(merged) == len(calls):
        return calls
    pair = next(([a, b] for a, b in zip(calls, calls[1:], strict=False) if len(_merge([a, b])) == 1), None)
    if pair is None:
        return calls
    with torch.no_grad():
        separate = torch.cat([hidden_of(layer(*a, **k)) for a, k in pair]).float()
        args, kwargs = _merge(pair)[0]
        try:
            together = hidden_of(layer(*args, **kwargs)).float()
        except (RuntimeError, ValueError, IndexError):  # an argument the merge misread: shapes that do not match
            return calls
    tolerance = 1e-4 * float(separate.abs().max()) + 1e-6
    if together.shape != separate.shape or not torch.allclose(together, separate, rtol=1e-3, atol=tolerance):
        return calls
    return merged


# ----------------------------------------------------------------------------------------------- the layer
@torch.no_grad()
def awq_layer(
    layer: nn.Module,
    inputs: LayerInputs,
    config: AWQConfig,
    prefix: str,
    weight_spec_of: Callable[[str], QuantizationSpec | None],
) -> dict[str, float]:
    """Scale search and clipping for one decoder layer (``prefix``: its name); returns the chosen ratio per scaling
    group. EquivalenceError when the folded scales changed what the layer computes (the caller restores it)."""
    modules = dict(named_modules_with_parts(layer))
    groups = []
    for g in scaling_groups(layer, config.scaling_layers):
        specs = [weight_spec_of(f"{prefix}.{n}") for n in g.layers]
        if any(s is not None for s in specs):
            groups.append((g, specs))
    clipped = {}
    for name, module in modules.items():
        spec = weight_spec_of(f"{prefix}.{name}")
        if (
            is_linear(module)
            and spec is not None
            and not any(k in name for k in _NO_CLIP)
            and _clippable(spec, linear_weight(module).shape[1])
        ):
            clipped[name] = (module, spec)
    if not groups and not clipped:
        return {}
    calls = _merged_calls(layer, inputs)
    tokens = sum(h.numel() // h.shape[-1] for h in (_batch_of(c) for c in calls) if h is not None)

    def plan(
        todo: list[ScalingGroup], clip: dict[str, tuple[nn.Module, QuantizationSpec]]
    ) -> tuple[dict[str, _InputStats], dict[str, nn.Module]]:
        stats: dict[str, _InputStats] = {}
        for g in todo:
            features = linear_weight(modules[g.layers[0]]).shape[1]
            s = stats.setdefault(g.inp, _InputStats(features))
            if not g.module2inspect:
                s.want_rows, s.want_gram = tokens <= features, s.want_gram or tokens > features
        for name, (module, spec) in clip.items():
            features = linear_weight(module).shape[1]
            entry = stats.setdefault(name, _InputStats(features))
            entry.block = _group_size(spec, features)
            entry.want_gram = entry.want_gram or CLIP_SWEEPS > 0
        return stats, {g.module2inspect: modules[g.module2inspect] for g in todo if g.module2inspect}

    stats, inspect = plan([g for g, _ in groups], clipped)
    captured, reference = _collect(layer, calls, stats, inspect)
    ratios: dict[str, float] = {}
    scaled: dict[str, torch.Tensor] = {}  # per module: the scale its inputs were divided by so far
    done: list[ScalingGroup] = []
    for g, specs in groups:
        group_stats, group_calls = stats.get(g.inp), captured.get(g.module2inspect or "")
        if any(g.inp in d.layers or g.prev_op == d.prev_op or set(g.layers) & set(d.layers) for d in done):
            fresh, fresh_inspect = plan([g], {})  # an earlier fold changed what this group reads: collect again
            group_calls = _collect(layer, calls, fresh, fresh_inspect)[0].get(g.module2inspect or "")
            group_stats = fresh[g.inp]
        done.append(g)
        if group_stats is None or not group_stats.tokens:
            continue  # the group's input never ran (an expert no calibration token reached)
        rows = producer_rows(g.rows, modules, g.prev_op, g.layers)
        ratio, s = _search_scale(g, modules, specs, group_stats, group_calls, rows)
        fold_scales(modules[g.prev_op], [modules[n] for n in g.layers], s, f"AWQ {g.prev_op} -> {g.layers}", rows=rows)
        ratios[g.prev_op] = ratio
        for n in g.layers:
            scaled[n] = scaled[n] * s if n in scaled else s
    if ratios:  # before clipping, which changes the function on purpose
        check_layer_kept("AWQ", prefix, layer, calls, reference)
    for name, (module, spec) in clipped.items():
        s = stats[name]
        if not s.tokens:
            continue
        if name in scaled:
            s.rescale(scaled[name])
        _search_clip(module, spec, s)
    return ratios


def _search_scale(
    group: ScalingGroup,
    modules: dict[str, nn.Module],
    specs: list[QuantizationSpec | None],
    stats: _InputStats,
    calls: LayerInputs | None,
    rows: torch.Tensor | None = None,
) -> tuple[float, torch.Tensor]:
    """(ratio, scale) of the grid point with the least output error; the channels that read one row of a fused
    producer (``rows``) tied to one scale (``fused_rows.tie_scales``) in every candidate."""
    linears = [modules[n] for n in group.layers]
    originals = [linear_weight(m).detach().clone() for m in linears]
    inspect = modules[group.module2inspect] if group.module2inspect else None
    reference = [hidden_of(inspect(*a, **k)).float() for a, k in calls or []] if inspect is not None else []
    x_mean = stats.mean_abs()
    best = (float("inf"), 0.0, torch.ones_like(x_mean))
    try:
        for i in range(N_GRID):
            ratio = i / N_GRID
            s = x_mean.pow(ratio).clamp(min=1e-4)
            s = tie_scales(s / (s.max() * s.min()).sqrt(), rows)
            quantized = []
            for w, spec in zip(originals, specs, strict=True):
                sw = s.reshape(1, -1).to(w.dtype)
                quantized.append(rtn(w * sw, spec) / sw)
            if inspect is not None:
                for m, q in zip(linears, quantized, strict=True):
                    linear_weight(m).copy_(q)
                loss = sum(
                    float((hidden_of(inspect(*a, **k)).float() - r).pow(2).sum())
                    for (a, k), r in zip(calls or [], reference, strict=True)
                )
            else:
                loss = sum(stats.output_error(q.float() - w.float()) for q, w in zip(quantized, originals, strict=True))
            if loss < best[0]:
                best = (loss, ratio, s)
    finally:
        for m, w in zip(linears, originals, strict=True):
            linear_weight(m).copy_(w)
    return best[1], best[2]


def _clippable(spec: QuantizationSpec, features: int) -> bool:
    """Integer weights with qparams per output row (per channel along dim 0) or per row and input group."""
    if spec.dtype.name.startswith(("mx", "bfp")):
        return False
    if spec.qscheme == QSchemeType.per_channel:
        return spec.ch_axis in (0, -2)
    if spec.qscheme == QSchemeType.per_group:
        return spec.ch_axis in (1, -1) and bool(spec.group_size) and features % spec.group_size == 0
    return False


def _group_size(spec: QuantizationSpec, features: int) -> int:
    return spec.group_size if spec.qscheme == QSchemeType.per_group and spec.group_size else features


def _search_clip(module: nn.Module, spec: QuantizationSpec, stats: _InputStats) -> None:
    """Clamp ``module``'s weight per output row and input group to the range (1.0 .. 0.55 of the group's max) with
    the least error of the group's partial output (from the diagonal blocks of the inputs' Gram matrix), refined
    row-wise by ``_refine_clip`` when the full Gram matrix is there."""
    blocks = stats.blocks
    group = _collected(stats.block, "group size in its input statistics")
    w = linear_weight(module).detach()
    out_features, in_features = w.shape
    wg = w.float().reshape(out_features, -1, group)
    max_val = wg.abs().amax(dim=-1, keepdim=True)
    best_err = torch.full(wg.shape[:2], float("inf"), device=w.device)
    best_idx = torch.zeros(wg.shape[:2], dtype=torch.long, device=w.device)
    deltas = []
    for i in range(CLIP_STEPS):
        cur = max_val * (1 - i / CLIP_GRID)
        clipped = torch.maximum(torch.minimum(wg, cur), -cur).reshape(out_features, in_features).to(w.dtype)
        delta = rtn(clipped, spec).float().reshape_as(wg) - wg  # [out, groups, group]
        deltas.append(delta)
        err = ((delta.transpose(0, 1) @ blocks) * delta.transpose(0, 1)).sum(dim=-1).T  # [out, groups]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_idx = torch.where(better, i, best_idx)
    if CLIP_SWEEPS and stats.gram is not None:
        best_idx = _refine_clip(torch.stack(deltas), best_idx, stats.gram, group)
    factor = 1 - best_idx.float().unsqueeze(-1) / CLIP_GRID
    best_max = max_val * factor
    clipped = torch.maximum(torch.minimum(wg, best_max), -best_max)
    linear_weight(module).copy_(clipped.reshape(out_features, in_features).to(w.dtype))


def _refine_clip(deltas: torch.Tensor, idx: torch.Tensor, gram: torch.Tensor, group: int) -> torch.Tensor:
    """Coordinate descent on the whole row's output error ``d^T H d`` (cross-group terms included): group after
    group, each row takes the candidate that lowers it most given the others. Never increases it.

    ``deltas`` [candidates, out, groups, group]: each candidate's weight change; ``idx`` [out, groups]: the
    candidates chosen so far (updated in place and returned)."""
    _, out_features, n_groups, _ = deltas.shape
    rows = torch.arange(out_features, device=deltas.device)
    current = deltas[idx, rows.unsqueeze(1), torch.arange(n_groups, device=deltas.device)].reshape(out_features, -1)
    hd = current @ gram  # [out, in]: H d for every row
    for _ in range(CLIP_SWEEPS):
        before = idx.clone()
        for g in range(n_groups):
            sl = slice(g * group, (g + 1) * group)
            diff = deltas[:, :, g] - current[:, sl]  # [candidates, out, group]; 0 for the current one
            gain = 2 * (diff * hd[:, sl]).sum(-1) + ((diff @ gram[sl, sl]) * diff).sum(-1)
            best = gain.argmin(dim=0)
            hd += diff[best, rows] @ gram[sl, :]
            current[:, sl] = deltas[best, rows, g]
            idx[:, g] = best
        if torch.equal(idx, before):
            break
    return idx
