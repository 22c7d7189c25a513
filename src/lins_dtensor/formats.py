"""Wire formats: what one element of a Lins collective costs on the wire, and the
kernels that encode and decode it.

Lins' own collectives move either gradients (the G-level reduce-scatter, the step's
reduce-scatter and all-reduce to the OS layout) or parameter values (the update gathers
of the masters back into P, and where P is sharded FSDP2's gathers of P for each forward
and backward, which Lins issues for FSDP2). Each of the two kinds may go on the wire in
a lossy format per link level ("inter": the group spans nodes, "intra": it does not),
chosen by the user or by the planner (:class:`CommFormats`):

* ``exact``: today's collectives, in the reduce dtype (gradients) or the parameter dtype
  (gathers); bitwise what Lins did before formats existed.
* ``bf16``: values rounded to bfloat16 (half the bytes of fp32).
* ``int8``: blocks of :data:`BLOCK` values scaled by their largest magnitude to int8,
  one fp32 scale per block (about a quarter of the bytes of fp32); for gradients with
  error feedback (what one step's rounding lost is added to the next step's input), as
  round-to-nearest on a coarse grid is biased step by step.

Reductions in a lossy format cannot run as NCCL/gloo reductions, which would sum in the
wire format: they run as an all-to-all of the encoded chunks and a local sum in fp32
(as ZeRO++'s qgZ does), and an all-reduce as that plus an all-gather of each rank's
encoded sum, which every rank, the one that summed included, decodes and uses, so that
every replica holds bitwise the same gradient. Gathers encode the sender's chunk once
and every rank, its owner included, takes the decoded values, so every rank computes
with bitwise identical parameters while the masters stay exact.
:mod:`lins_dtensor.schedule` counts the encoded bytes with :func:`encoded_bytes`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch

from lins_dtensor.errors import LinsConfigError

BLOCK = 256  # int8: values per scale (a 1.6 % overhead of fp32 scales)
KINDS = ("grads", "params")  # what a collective carries: gradients, or parameter values
LEVELS = ("inter", "intra")


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """One way to put values on the wire.

    Attributes:
        name (str): as written in settings.
        element_bytes (int): bytes of one encoded value (0: the collective's own dtype).
        block (int): values per fp32 scale (0: no scales).
        error_feedback (bool): carry each rank's rounding error into its next input
            (gradients only: parameter values are re-encoded from exact masters each step).
        offered (bool): whether the planner may choose it (it converged like fp32 in
            docs/convergence.md); a user may still name it.
    """

    name: str
    element_bytes: int
    block: int = 0
    error_feedback: bool = False
    offered: bool = True

    @property
    def lossy(self) -> bool:
        return self.name != "exact"

    def chunk_bytes(self, numel: int, exact_bytes: int) -> int:
        """Encoded bytes of one chunk of ``numel`` values (``exact_bytes`` each when exact)."""
        if not self.lossy:
            return numel * exact_bytes
        if not self.block:
            return numel * self.element_bytes
        blocks = math.ceil(numel / self.block)
        return blocks * (self.block * self.element_bytes + 4)

    # ----- kernels ----------------------------------------------------------------------
    def encode(self, values: torch.Tensor, chunks: int, out: torch.Tensor) -> torch.Tensor:
        """Encode ``values`` (flat, any float dtype) cut into ``chunks`` equal rows into
        ``out`` (uint8, ``chunks`` rows of :meth:`chunk_bytes`), each row on its own so
        that any row can be decoded alone. Deterministic: the same values give the same
        bytes on every rank."""
        rows = values.view(chunks, -1)
        grid = out.view(chunks, -1)
        if not self.block:
            grid.view(torch.bfloat16).copy_(rows)
            return out
        numel = rows.shape[1]
        blocks = math.ceil(numel / self.block)
        if numel % self.block or rows.dtype != torch.float32:
            whole = rows.new_zeros(chunks, blocks * self.block, dtype=torch.float32)
            whole[:, :numel].copy_(rows)
        else:
            whole = rows
        whole = whole.view(chunks, blocks, self.block)
        # Few passes over the values (this runs on every lossy collective): two
        # reductions for the largest magnitude, one scaling, one rounding, one cast.
        largest = torch.maximum(whole.amax(dim=2, keepdim=True), whole.amin(dim=2, keepdim=True).neg_())
        scale = torch.where(largest > 0, largest / 127.0, torch.ones_like(largest))
        quantised = torch.mul(whole, scale.reciprocal()).round_()  # within [-127, 127] by the scale's choice
        grid[:, : blocks * self.block].view(torch.int8).copy_(quantised.view(chunks, -1))
        grid[:, blocks * self.block :].view(torch.float32).copy_(scale.view(chunks, blocks))
        return out

    def decode(self, encoded: torch.Tensor, chunks: int, numel: int) -> torch.Tensor:
        """The ``chunks`` x ``numel`` fp32 values that ``encoded`` holds."""
        grid = encoded.view(chunks, -1)
        if not self.block:
            return grid.view(torch.bfloat16).to(torch.float32)
        blocks = math.ceil(numel / self.block)
        quantised = grid[:, : blocks * self.block].view(torch.int8).view(chunks, blocks, self.block)
        scale = grid[:, blocks * self.block :].view(torch.float32).view(chunks, blocks, 1)
        return (quantised.to(torch.float32) * scale).view(chunks, -1)[:, :numel]


EXACT = WireFormat("exact", 0)
FORMATS = {f.name: f for f in (EXACT, WireFormat("bf16", 2), WireFormat("int8", 1, BLOCK, error_feedback=True))}


def wire_format(name: str) -> WireFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise LinsConfigError(f"comm_formats: unknown format '{name}'; choose from {', '.join(FORMATS)}") from None


@dataclasses.dataclass(frozen=True)
class CommFormats:
    """The wire format of each kind of Lins collective on each link level.

    Written as text: ``"exact"``, or a comma list of ``kind[:level]=format``, where
    kind is ``grads`` (every gradient reduction Lins issues) or ``params`` (the update
    gathers of the masters into P, and where P is sharded FSDP2's per-micro-batch gathers
    of P), level ``inter`` (the default: groups that span nodes) or ``intra``, format one
    of :data:`FORMATS`; e.g. ``"grads=int8,params=bf16"`` or
    ``"grads=bf16,grads:intra=bf16"``. Unnamed entries stay exact; FSDP2's P-group
    reduce-scatters are always exact.
    """

    grads_inter: str = "exact"
    grads_intra: str = "exact"
    params_inter: str = "exact"
    params_intra: str = "exact"

    @classmethod
    def parse(cls, text: "str | CommFormats | None") -> "CommFormats":
        if text is None:
            return cls()
        if isinstance(text, CommFormats):
            return text
        choices = parse_allowed(text)
        if any(len(names) > 2 for names in choices.values()):
            raise LinsConfigError(f"comm_formats '{text}': one format per kind and level here ('|' lists what the planner may choose from)")
        return cls(**{key: names[-1] for key, names in choices.items()})

    def of(self, kind: str, level: str) -> WireFormat:
        return FORMATS[getattr(self, f"{kind}_{level}")]

    @property
    def lossy(self) -> bool:
        return self.lossy_settings > 0

    @property
    def lossy_settings(self) -> int:
        """How many (kind, link level) pairs round their values on the wire."""
        return sum(FORMATS[v].lossy for v in dataclasses.astuple(self))

    def __str__(self) -> str:
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != "exact":
                kind, level = field.name.split("_")
                parts.append(f"{kind}={value}" if level == "inter" else f"{kind}:{level}={value}")
        return ",".join(parts) or "exact"

    def as_json(self) -> dict | str:
        """Per kind, each level's format, or "exact" when nothing is compressed."""
        if not self.lossy:
            return "exact"
        return {kind: {level: getattr(self, f"{kind}_{level}") for level in LEVELS} for kind in KINDS}

    @classmethod
    def from_json(cls, value: dict | str) -> "CommFormats":
        """The inverse of :meth:`as_json`."""
        if value == "exact":
            return cls()
        return cls(**{f"{kind}_{level}": name for kind, levels in value.items() for level, name in levels.items()})

    def check(self, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        """Raise a one-line :class:`LinsConfigError` for a format that cannot save bytes."""
        for level in LEVELS:
            fmt = self.of("params", level)
            if fmt.lossy and not fmt.block and param_dtype.itemsize <= fmt.element_bytes:
                raise LinsConfigError(
                    f"comm_formats params:{level}={fmt.name}: the parameters are already {param_dtype} (param_dtype); "
                    "bf16 gathers would save nothing (int8 would)"
                )


def parse_allowed(text: str) -> dict[str, tuple[str, ...]]:
    """``"grads=int8|bf16,params=bf16"`` as, per ``<kind>_<level>``, the formats allowed
    there (exact always among them, first)."""
    allowed = {f"{kind}_{level}": ("exact",) for kind in KINDS for level in LEVELS}
    spec = text.strip().lower()
    if spec in ("", "exact"):
        return allowed
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, eq, value = item.partition("=")
        kind, _, level = key.strip().partition(":")
        level = level or "inter"
        if not eq or kind not in KINDS or level not in LEVELS:
            raise LinsConfigError(
                f"comm_formats '{text}': expected 'kind[:level]=format' with kind in {KINDS} and level in {LEVELS}, got '{item}'"
            )
        names = tuple(wire_format(name.strip()).name for name in value.split("|"))
        allowed[f"{kind}_{level}"] = ("exact", *(n for n in dict.fromkeys(names) if n != "exact"))
    return allowed


def format_choices(allowed: dict[str, tuple[str, ...]], *, offered_only: bool = True) -> Iterator[CommFormats]:
    """Every :class:`CommFormats` the ``allowed`` sets (:func:`parse_allowed`) permit,
    exact first; with ``offered_only`` without formats the planner does not offer."""
    keys = list(allowed)
    options = [[n for n in allowed[k] if not offered_only or FORMATS[n].offered] for k in keys]

    def walk(i: int, chosen: dict[str, str]) -> Iterator[CommFormats]:
        if i == len(keys):
            yield CommFormats(**chosen)
            return
        for name in options[i]:
            yield from walk(i + 1, {**chosen, keys[i]: name})

    yield from walk(0, {})
