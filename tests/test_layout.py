"""ChunkLayout: the padded chunking must be torch.chunk's (and so DTensor Shard(0)'s)."""

from __future__ import annotations

import pytest
import torch

from lins_dtensor.layout import ChunkLayout, chunk_rows

pytestmark = pytest.mark.quick  # in one process


def test_chunk_rows_is_torch_chunk():
    for rows in range(0, 20):
        for k in range(1, 9):
            actual = [c.shape[0] for c in torch.chunk(torch.empty(rows, 1), k)] if rows else []
            actual += [0] * (k - len(actual))
            assert [chunk_rows(rows, k, i) for i in range(k)] == actual, (rows, k)


def test_pack_then_unpack_round_trips_and_chunks_like_torch():
    tensors = [torch.randn(5, 3), torch.randn(2), torch.randn(7, 2, 2), torch.randn(0, 4)]
    rows = tuple(t.shape[0] for t in tensors)
    row_numels = tuple(t[0].numel() if t.shape[0] else 4 for t in tensors)
    for k in (1, 2, 3, 4):
        layout = ChunkLayout(rows, row_numels, k)
        flat = layout.pack(tensors, torch.full((layout.total_numel,), float("nan")))
        assert not flat.isnan().any(), "padding must be written (zeros)"
        out = [torch.full_like(t, float("nan")) for t in tensors]
        layout.unpack_into(flat, out)
        for t, back in zip(tensors, out):
            assert torch.equal(back, t)
        grid = flat.view(k, layout.chunk_numel)
        for j in range(k):
            for t, view in zip(tensors, layout.views(grid[j], j)):
                expected = torch.chunk(t, k)[j] if j < len(torch.chunk(t, k)) and t.shape[0] else t[:0]
                assert torch.equal(view.reshape(expected.shape), expected)


def test_next_level_nests_inside_the_chunk():
    layout = ChunkLayout((50,), (24,), 2)  # P: 25 rows each
    finer = layout.next_level(1, 2)  # G inside P chunk 1: 13 + 12
    assert finer.rows == (25,) and [finer.chunk_rows(i) for i in (0, 1)] == [(13,), (12,)]
