"""Where each parameter's shard sits inside a flat, padded communication buffer.

Lins batches the tensors of one FSDP unit into one buffer per collective, as FSDP2
does: every tensor is cut into ``k`` row chunks the way ``torch.chunk`` (and DTensor
``Shard(0)``) cuts it, each chunk padded to ``ceil(rows / k)`` rows, and chunk ``j``
of every tensor is placed in row ``j`` of a ``(k, chunk_numel)`` buffer. A
reduce-scatter of that buffer leaves row ``j`` on group rank ``j``; an all-gather
rebuilds it. The same geometry gives the planner its message sizes, so the bytes it
predicts are the bytes the runtime sends.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from lins_dtensor.compat import chunk_cat


def chunk_rows(rows: int, k: int, index: int) -> int:
    """Rows of chunk ``index`` when ``rows`` are cut into ``k`` chunks like torch.chunk."""
    per_chunk = math.ceil(rows / k) if rows else 0
    return max(0, min(per_chunk, rows - index * per_chunk))


def chunk_start(rows: int, k: int, index: int) -> int:
    """First row of chunk ``index`` (an empty chunk starts at the end, so that narrowing
    by it stays in range)."""
    return min(index * math.ceil(rows / k), rows) if rows else 0


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """``k``-way chunking of tensors with ``rows[i]`` rows of ``row_numels[i]`` elements."""

    rows: tuple[int, ...]
    row_numels: tuple[int, ...]
    k: int

    @property
    def padded_rows(self) -> tuple[int, ...]:
        return tuple(math.ceil(r / self.k) if r else 0 for r in self.rows)

    @property
    def slot_numels(self) -> tuple[int, ...]:
        """Elements of each tensor inside one chunk row (padding included)."""
        return tuple(p * n for p, n in zip(self.padded_rows, self.row_numels))

    @property
    def offsets(self) -> tuple[int, ...]:
        out, total = [], 0
        for numel in self.slot_numels:
            out.append(total)
            total += numel
        return tuple(out)

    @property
    def chunk_numel(self) -> int:
        """Elements of one chunk row: what each rank holds after a reduce-scatter."""
        return sum(self.slot_numels)

    @property
    def total_numel(self) -> int:
        """Elements of the whole buffer: reduce-scatter input / all-gather output."""
        return self.k * self.chunk_numel

    def chunk_rows(self, index: int) -> tuple[int, ...]:
        """Real (unpadded) rows of each tensor in chunk ``index``."""
        return tuple(chunk_rows(r, self.k, index) for r in self.rows)

    def next_level(self, index: int, k: int) -> "ChunkLayout":
        """The layout of chunk ``index`` cut again ``k`` ways (the next, finer state)."""
        return ChunkLayout(self.chunk_rows(index), self.row_numels, k)

    # ----- moving data in and out ----------------------------------------------------
    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write ``tensors`` (each with ``rows[i]`` rows) chunked into ``out`` (flat, in
        its dtype): one pass, padding zero-filled."""
        grid = out.view(self.k, self.chunk_numel)
        if self.k == 1:
            for view, tensor in zip(self.views(out, 0), tensors):
                view.copy_(tensor.reshape(view.shape))
            return out
        # Empty shards occupy no slot; chunk_cat refuses them.
        flat_rows = [t.reshape(r, n) for t, r, n in zip(tensors, self.rows, self.row_numels) if r]
        if flat_rows:
            chunk_cat(flat_rows, self.k, grid)
        else:
            out.zero_()
        return out

    def views(self, chunk: torch.Tensor, index: int) -> list[torch.Tensor]:
        """Views of each tensor's real rows inside one flat chunk row (chunk ``index``)."""
        return [
            chunk[offset : offset + rows * numel].view(rows, numel)
            for offset, rows, numel in zip(self.offsets, self.chunk_rows(index), self.row_numels)
        ]

    def unpack_into(self, full: torch.Tensor, dests: Sequence[torch.Tensor]) -> None:
        """Copy each tensor's real rows out of an all-gathered buffer into ``dests``
        (contiguous, ``rows[i]`` rows each), with no intermediate buffer: the chunks that
        are whole move in one strided copy, the one short chunk in a second."""
        grid = full.view(self.k, self.chunk_numel)
        for offset, padded, rows, numel, dest in zip(self.offsets, self.padded_rows, self.rows, self.row_numels, dests):
            if not rows:
                continue
            dest = dest.view(rows, numel)
            whole = rows // padded
            if whole:
                dest[: whole * padded].view(whole, padded * numel).copy_(grid[:whole, offset : offset + padded * numel])
            rest = rows - whole * padded
            if rest:
                dest[whole * padded :].view(1, rest * numel).copy_(grid[whole : whole + 1, offset : offset + rest * numel])
