"""How long one collective takes: a measured table, or an alpha-beta model without one.

The Lins paper profiles each collective per message size and group shape rather than
trusting a formula, because small messages and wide rings are latency-bound. A group
shape is (ranks of the group per node, nodes): since every data-parallel group of a
mesh dim runs at the same time, ranks_per_node / r groups share each node's NICs, which
the shape captures for a fixed node size. Tables are JSON (written by ``lins-plan
profile``); times between measured sizes are interpolated in log-log space.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from pathlib import Path

from lins_dtensor.planner.hardware import HardwareSpec
from lins_dtensor.planner.models import PlannerError, read_json
from lins_dtensor.schedule import Op

FORMAT = "lins-bandwidth/1"
OPS = tuple(op.value for op in Op)


def ring_factor(op: str, group_size: int) -> float:
    """Bytes each rank sends per message byte with the ring algorithm. An all-to-all (a
    reduction in a lossy wire format) sends every chunk of its input but its own once,
    (n-1)/n of the message, as a reduce-scatter does: what differs is only where the
    bytes go (see :func:`cross_node_bytes`), not how many each rank sends."""
    n = group_size
    return (2.0 if op == Op.ALL_REDUCE.value else 1.0) * (n - 1) / n


def cross_node_bytes(op: str, group_size: int, nodes: int, message_bytes: float) -> float:
    """Bytes one group sends through each of its nodes' NICs per call. A ring crosses
    each node boundary once, so a node's NICs carry one rank's wire bytes; an all-to-all
    has each of the node's r ranks send its chunks for the other nodes' ranks directly,
    (n - r)/n of its message each, which no ring or sum along the way shares: r (n-r)/n of
    the message (the ring's (n-1)/n when the group has one rank per node)."""
    if nodes <= 1:
        return 0.0
    if op == Op.ALL_TO_ALL.value:
        r = group_size // nodes
        return r * (group_size - r) / group_size * message_bytes
    return ring_factor(op, group_size) * message_bytes


def alpha_beta_seconds(hw: HardwareSpec, ranks_per_node: int, op: str, group_size: int, nodes: int, message_bytes: float) -> float:
    """Ring time: (steps) x alpha + the slower of the NVLink leg and the node's NIC share.

    A group with r ranks on each of its nodes shares the node's NICs with the other
    ranks_per_node / r groups of the same dim, so it gets r / ranks_per_node of them.
    An all-reduce across nodes takes NCCL's tree instead when its latency, which grows
    with log2(nodes) rather than with the ranks, is lower (at large messages both reach
    the same bus bandwidth). A backend that reduce-scatters by all-reducing
    (``reduce_scatter_is_all_reduce``: gloo) takes an all-reduce's time.
    """
    if group_size <= 1:
        return 0.0
    if op == Op.REDUCE_SCATTER.value and hw.reduce_scatter_is_all_reduce:
        op = Op.ALL_REDUCE.value
    wire = ring_factor(op, group_size) * message_bytes
    steps = (2 if op == Op.ALL_REDUCE.value else 1) * (group_size - 1)
    if nodes <= 1:
        return steps * hw.alpha_intra + wire / hw.intra_bw
    r = group_size // nodes
    inter_share = hw.inter_bw * r / ranks_per_node
    latency = steps * hw.alpha_inter
    if op == Op.ALL_REDUCE.value:
        latency = min(latency, hw.tree_alpha + hw.tree_alpha_per_doubling * math.log2(nodes))
    return latency + max(wire / hw.intra_bw, cross_node_bytes(op, group_size, nodes, message_bytes) / inter_share)


def monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """A bigger message never takes less time: smooth measurement noise with a running max."""
    out, worst = [], 0.0
    for size, seconds in points:
        worst = max(worst, seconds)
        out.append((size, worst))
    return out


@dataclasses.dataclass
class BandwidthTable:
    """Measured seconds per call, keyed by (op, ranks per node in group, nodes)."""

    ranks_per_node: int
    entries: dict[tuple[str, int, int], list[tuple[float, float]]]  # sorted (bytes, seconds)
    meta: dict = dataclasses.field(default_factory=dict)

    def shapes(self) -> set[tuple[str, int, int]]:
        return set(self.entries)

    def seconds(self, op: str, group_size: int, nodes: int, message_bytes: float) -> float | None:
        """Interpolated time of one call, or None when this shape was not measured."""
        if group_size <= 1:
            return 0.0
        points = self.entries.get((op, group_size // nodes, nodes))
        if not points:
            return None
        sizes = [s for s, _ in points]
        if message_bytes <= sizes[0]:
            # Below the smallest size: latency-bound, no faster than the smallest call.
            return points[0][1]
        if message_bytes >= sizes[-1]:
            # Above the largest: bandwidth-bound, scale with the largest call's rate.
            return points[-1][1] * message_bytes / sizes[-1]
        i = bisect.bisect_right(sizes, message_bytes)
        (s0, t0), (s1, t1) = points[i - 1], points[i]
        w = (math.log(message_bytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))

    # ----- JSON ------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "ranks_per_node": self.ranks_per_node,
            "meta": self.meta,
            "entries": [
                {"op": op, "group_ranks_per_node": r, "nodes": m, "bytes": [s for s, _ in pts], "seconds": [t for _, t in pts]}
                for (op, r, m), pts in sorted(self.entries.items())
            ],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: dict) -> "BandwidthTable":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlannerError(f"bandwidth table is not a '{FORMAT}' JSON object (write one with 'lins-plan profile')")
        entries: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
        try:
            for e in data["entries"]:
                if e["op"] not in OPS:
                    raise PlannerError(f"bandwidth table: unknown op '{e['op']}'")
                pts = sorted((float(s), float(t)) for s, t in zip(e["bytes"], e["seconds"]) if float(s) > 0 and float(t) > 0)
                entries[(e["op"], int(e["group_ranks_per_node"]), int(e["nodes"]))] = monotone(pts)
            return cls(int(data["ranks_per_node"]), entries, dict(data.get("meta", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlannerError(f"bandwidth table is malformed: {exc!r}") from None

    @classmethod
    def load(cls, path: str | Path) -> "BandwidthTable":
        return cls.from_json(read_json(path, "bandwidth table"))


@dataclasses.dataclass
class CollectiveTimer:
    """Times collectives from the table where it has the shape, else from alpha-beta."""

    hardware: HardwareSpec
    ranks_per_node: int
    table: BandwidthTable | None = None
    fallbacks: set = dataclasses.field(default_factory=set)  # shapes the table lacked

    def __post_init__(self) -> None:
        if self.table is not None and self.table.ranks_per_node != self.ranks_per_node:
            raise PlannerError(
                f"bandwidth table was measured with {self.table.ranks_per_node} ranks per node, "
                f"the cluster has {self.ranks_per_node}"
            )

    def seconds(self, op: str, group_size: int, nodes: int, message_bytes: float) -> float:
        if self.table is not None:
            t = self.table.seconds(op, group_size, nodes, message_bytes)
            if t is None and op == Op.ALL_TO_ALL.value:
                # A table from before all-to-alls were profiled: its reduce-scatter of the
                # same shape and message sends the same bytes per rank, measured on these
                # links, which is closer than alpha-beta (under gloo, whose reduce-scatter
                # all-reduces, it errs slow).
                t = self.table.seconds(Op.REDUCE_SCATTER.value, group_size, nodes, message_bytes)
            if t is not None:
                return t
            self.fallbacks.add((op, group_size // nodes, nodes))
        return alpha_beta_seconds(self.hardware, self.ranks_per_node, op, group_size, nodes, message_bytes)
