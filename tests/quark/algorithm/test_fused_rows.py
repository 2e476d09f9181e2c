"""Folding a scale through a fused producer (issue 35): only the rows that feed the consumer are divided, each by
the scale its consumer channels share (grouped-query attention ties the query heads of one kv head).

References are hand computations on small Linear pairs, and for grouped-query attention amd-quark's own reduction
(``scales.view(kv_heads, repeat, head_dim).max(dim=1)``, written out here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from quark.torch.algorithm.fused_rows import FusedRows, producer_rows, row_scales, tie_scales
from quark.torch.algorithm.smoothquant import fold_scales

PHI3_QKV = FusedRows(("all", "kv", "kv"), 2, "attn.head_dim")
NEOX_QKV = FusedRows(("all", "all", "all"), 2, "attn.head_dim", per_head=True)
UP_HALF = FusedRows(("all", "all"), 1)


def layer(produced: int, channels: int, head_dim: int | None = None, bias: bool = True) -> dict[str, nn.Module]:
    """The modules of a decoder layer, by name: ``prev`` (in 3 -> ``produced``), ``next`` (``channels`` -> 2), an
    ``attn`` module holding ``head_dim``."""
    torch.manual_seed(0)
    attn = nn.Module()
    attn.head_dim = head_dim  # type: ignore[assignment]
    return {"prev": nn.Linear(3, produced, bias=bias), "next": nn.Linear(channels, 2), "attn": attn}


def rows_of(spec: FusedRows, modules: dict[str, nn.Module]) -> list[int]:
    return producer_rows(spec, modules, "prev", ["next"]).tolist()  # type: ignore[union-attr]


# ----------------------------------------------------------------------------------------------- which rows
def test_phi3_qkv_with_grouped_query_attention_reads_the_last_rows_once_per_query_head() -> None:
    """4 query heads of 2 channels, 2 kv heads: [q 8 | k 4 | v 4]; query heads 0, 1 read kv head 0 (v rows 12, 13),
    heads 2, 3 kv head 1 (rows 14, 15)."""
    assert rows_of(PHI3_QKV, layer(16, 8, head_dim=2)) == [12, 13, 12, 13, 14, 15, 14, 15]


def test_phi3_qkv_without_grouped_query_attention_reads_the_last_third() -> None:
    assert rows_of(PHI3_QKV, layer(12, 4, head_dim=2)) == [8, 9, 10, 11]


def test_gate_up_reads_the_up_half() -> None:
    assert rows_of(UP_HALF, layer(10, 5)) == [5, 6, 7, 8, 9]


def test_gpt_neox_reads_the_v_rows_of_each_head() -> None:
    """3 heads of 2 channels, per head [q_h | k_h | v_h]: v of head h is rows 6h + 4, 6h + 5."""
    assert rows_of(NEOX_QKV, layer(18, 6, head_dim=2)) == [4, 5, 10, 11, 16, 17]


def test_per_head_with_grouped_query_attention() -> None:
    """Falcon's new layout, per kv head [q (2 heads) | k | v], head 2: kv head g spans rows 8g .. 8g + 7."""
    spec = FusedRows(("all", "kv", "kv"), 2, "attn.head_dim", per_head=True)
    assert rows_of(spec, layer(16, 8, head_dim=2)) == [6, 7, 6, 7, 14, 15, 14, 15]


@pytest.mark.parametrize(
    ("spec", "produced", "channels", "head_dim"),
    [
        (PHI3_QKV, 15, 8, 2),  # 7 rows left for two kv parts
        (PHI3_QKV, 16, 8, 3),  # kv rows not whole heads
        (PHI3_QKV, 16, 8, None),  # no head size on the module
        (UP_HALF, 9, 5, None),  # not two halves
        (NEOX_QKV, 18, 6, 4),  # heads do not divide the channels
    ],
)
def test_a_layout_that_does_not_fit_the_shapes_is_refused_by_name(
    spec: FusedRows, produced: int, channels: int, head_dim: int | None
) -> None:
    with pytest.raises(ValueError, match=rf"prev -> \['next'\]: {produced} output rows of prev.*fused layout"):
        rows_of(spec, layer(produced, channels, head_dim))


def test_a_malformed_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="each part must be 'all' or 'kv'"):
        FusedRows(("q", "k", "v"), 2)
    with pytest.raises(ValueError, match="feeds=3"):
        FusedRows(("all", "all"), 3)
    with pytest.raises(ValueError, match="need head_dim"):
        FusedRows(("all", "kv", "kv"), 2)


# ----------------------------------------------------------------------------------------------- the scales
def test_tied_scales_are_the_largest_of_the_query_heads_of_each_kv_head_as_amd_quark_reduces() -> None:
    """amd-quark (``scale_fc_fc``): ``scales.view(kv_heads, repeat, head_dim).max(dim=1)`` for the v rows, expanded
    back for o_proj."""
    kv_heads, repeat, head = 2, 3, 4
    produced = repeat * kv_heads * head + 2 * kv_heads * head  # [q | k | v]
    modules = layer(produced, repeat * kv_heads * head, head_dim=head)
    rows = producer_rows(PHI3_QKV, modules, "prev", ["next"])
    s = torch.rand(repeat * kv_heads * head, generator=torch.Generator().manual_seed(1)) + 0.5
    reduced = s.view(kv_heads, repeat, head).amax(dim=1)
    assert torch.equal(tie_scales(s, rows), reduced.unsqueeze(1).expand(kv_heads, repeat, head).reshape(-1))
    expected_rows = torch.cat([torch.ones(produced - kv_heads * head), reduced.reshape(-1)])
    assert torch.equal(row_scales(s, rows, produced), expected_rows)
    assert tie_scales(s, None) is s


def test_fold_divides_exactly_the_rows_that_feed_the_consumer() -> None:
    """Phi-3's qkv with 2 query heads per kv head (head 2, 2 kv heads): channel scales 1..8 are tied per kv head to
    [3, 4, 3, 4, 7, 8, 7, 8]; v rows 12..15 of prev are divided by 3, 4, 7, 8 (weight and bias), rows 0..11 kept
    bit for bit, next's columns multiplied by the tied scales; what next computes from prev's v rows is kept."""
    modules = layer(16, 8, head_dim=2)
    prev, nxt = modules["prev"], modules["next"]
    w, b, w2 = prev.weight.detach().clone(), prev.bias.detach().clone(), nxt.weight.detach().clone()
    rows = producer_rows(PHI3_QKV, modules, "prev", ["next"])
    x = torch.randn(5, 3)
    before = nxt(prev(x)[:, rows])
    fold_scales(prev, [nxt], torch.arange(1.0, 9.0), "test", rows=rows)
    divisor = torch.tensor([3.0, 4.0, 7.0, 8.0])
    assert torch.equal(prev.weight[:12], w[:12]) and torch.equal(prev.bias[:12], b[:12])
    assert torch.equal(prev.weight[12:], w[12:] / divisor[:, None])
    assert torch.equal(prev.bias[12:], b[12:] / divisor)
    assert torch.equal(nxt.weight, w2 * torch.tensor([3.0, 4, 3, 4, 7, 8, 7, 8]))
    with torch.no_grad():
        torch.testing.assert_close(nxt(prev(x)[:, rows]), before, rtol=1e-6, atol=1e-6)


def test_fold_into_the_up_half_keeps_a_gated_mlp() -> None:
    """gate_up -> act(gate) * up -> down: the gate rows stay, the up rows are divided."""
    torch.manual_seed(0)
    gate_up, down = nn.Linear(6, 8, bias=False), nn.Linear(4, 6, bias=False)
    gate_before = gate_up.weight[:4].detach().clone()

    def mlp(x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(nn.functional.silu(gate) * up)

    x = torch.randn(7, 6)
    before = mlp(x)
    rows = producer_rows(UP_HALF, {"prev": gate_up, "next": down}, "prev", ["next"])
    fold_scales(gate_up, [down], torch.tensor([0.5, 2.0, 3.0, 0.25]), "test", rows=rows)
    assert torch.equal(gate_up.weight[:4], gate_before)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), before, rtol=1e-6, atol=1e-6)


def test_without_rows_the_fold_is_as_before() -> None:
    """v_proj -> o_proj: every row divided by its channel's scale."""
    modules = layer(4, 4)
    prev, nxt = modules["prev"], modules["next"]
    w, w2 = prev.weight.detach().clone(), nxt.weight.detach().clone()
    s = torch.tensor([1.0, 2.0, 4.0, 8.0])
    fold_scales(prev, [nxt], s, "test")
    assert torch.equal(prev.weight, w / s[:, None]) and torch.equal(nxt.weight, w2 * s)


def test_rows_need_a_producer_with_a_weight() -> None:
    with pytest.raises(ValueError, match="test: cannot fold a scale into SimpleNamespace"):
        fold_scales(SimpleNamespace(), [nn.Linear(2, 2)], torch.ones(2), "test", rows=torch.tensor([1, 0]))  # type: ignore[arg-type]
