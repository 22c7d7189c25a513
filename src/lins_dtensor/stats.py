"""What Lins did in the last step: collectives by state, op and link, how much of their
time was exposed, and memory per state."""

from __future__ import annotations

import dataclasses

from torch import nn

from lins_dtensor.collectives import CommTiming
from lins_dtensor.optimizer import optimizer_state_bytes
from lins_dtensor.runtime import lins_state
from lins_dtensor.schedule import CollectiveRecord, summarize


@dataclasses.dataclass(frozen=True)
class LinsStats:
    """One optimizer step's communication and this rank's memory, from :func:`lins_stats`.

    Attributes:
        plan (str): the plan, as ``LinsPlan`` prints it.
        collectives (list[CollectiveRecord]): one finished optimizer step's collectives on
            this rank (:mod:`lins_dtensor.schedule` names them).
        timings (list[CommTiming]): each collective's timing, in the same order.
        memory_bytes (dict[str, int]): persistent bytes per state ("params", "grads",
            "optim"; with lossy formats "feedback", the error-feedback residuals) on this rank.
        blocking (bool): whether reading device timings may block the host until their
            events complete (``lins_stats(wait=True)``); else timings not yet complete
            count as unmeasured.
    """

    plan: str
    collectives: list[CollectiveRecord]  # one finished optimizer step (lins_stats), on this rank
    timings: list[CommTiming]  # one per record, same order
    memory_bytes: dict[str, int]  # persistent bytes per state on this rank
    # Whether reading device timings may block the host until their events complete
    # (lins_stats(wait=True)); else timings not yet complete count as unmeasured.
    blocking: bool = True

    def bytes_by(self, state: str | None = None, op: str | None = None, link: str | None = None, wire: bool = False) -> float:
        """Sum of message (or ring wire) bytes over the records matching the filters."""
        key = "wire_bytes" if wire else "message_bytes"
        return sum(
            v[key]
            for (s, o, lk), v in summarize(self.collectives).items()
            if (state is None or s == state) and (op is None or o == op) and (link is None or lk == link)
        )

    def bytes_by_format(self) -> dict[str, float]:
        """Message bytes per wire format ("exact" included, :mod:`lins_dtensor.formats`)."""
        out: dict[str, float] = {}
        for r in self.collectives:
            out[r.format] = out.get(r.format, 0) + r.message_bytes * r.count
        return out

    @property
    def compression_ratio(self) -> float:
        """Wire bytes the step's collectives would have sent exact over what they sent
        (1.0 with every format exact)."""
        sent = sum(r.wire_bytes for r in self.collectives)
        return sum(r.exact_wire_bytes for r in self.collectives) / sent if sent else 1.0

    def comm_time(self) -> dict[str, dict[str, float]]:
        """Per state: seconds of collective time that something waited for ("exposed")
        and that ran behind compute ("hidden"), plus how many collectives could not be
        timed ("unmeasured": FSDP2's own on an accelerator)."""
        out: dict[str, dict[str, float]] = {}
        for timing in self.timings:
            entry = out.setdefault(timing.state, {"exposed": 0.0, "hidden": 0.0, "unmeasured": 0})
            if not timing.resolve(block=self.blocking):
                entry["unmeasured"] += 1
                continue
            exposed, hidden = timing.exposed, timing.hidden
            if exposed is None or hidden is None:
                entry["unmeasured"] += 1
            else:
                entry["exposed"] += exposed
                entry["hidden"] += hidden
        return out

    @property
    def comm_seconds(self) -> float:
        """All exposed collective time of the step (what communication added to it)."""
        return sum(entry["exposed"] for entry in self.comm_time().values())

    def scalars(self) -> dict[str, float]:
        """Flat ``lins/...`` names for a metrics logger (TensorBoard)."""
        out: dict[str, float] = {}
        for (state, op, link), v in summarize(self.collectives).items():
            out[f"lins/bytes/{state}/{op}/{link}"] = v["message_bytes"]
        for state, entry in self.comm_time().items():
            out[f"lins/comm/exposed_s/{state}"] = entry["exposed"]
            out[f"lins/comm/hidden_s/{state}"] = entry["hidden"]
        out["lins/comm_seconds"] = self.comm_seconds
        for fmt, nbytes in self.bytes_by_format().items():
            out[f"lins/bytes_by_format/{fmt}"] = nbytes
        out["lins/compression_ratio"] = self.compression_ratio
        for state, nbytes in self.memory_bytes.items():
            out[f"lins/memory/{state}"] = nbytes
        return out


def lins_stats(model: nn.Module, *, wait: bool = True) -> LinsStats:
    """The statistics of the last optimizer step whose collectives have all finished.

    Args:
        model (nn.Module): a model :func:`~lins_dtensor.apply_lins` has sharded.
        wait (bool): ``True`` first waits for the last step's update gathers (still in
            flight until the next forward needs them), so the answer is the last step,
            and on an accelerator reading its collectives' times waits for their events.
            ``False`` never blocks: while the gathers are in flight it answers for the
            step before, and a collective whose device events have not all completed
            counts as unmeasured; a metrics logger should use it so that logging does
            not take the gathers' overlap with the next forward away (the torchtitan
            integration does).

    Returns:
        LinsStats: the step's collectives (bytes, exposed and hidden time by state, op
        and link) and this rank's persistent bytes per state.
    """
    state = lins_state(model)
    if wait:
        state.wait_for_updates()
    records, timings = state.recorder.ended(2 if state.updates_in_flight() else 1)
    return LinsStats(str(state.plan), list(records), list(timings), memory_bytes(model), blocking=wait)


def memory_bytes(model: nn.Module) -> dict[str, int]:
    """Persistent bytes this rank holds per state, measured on the live tensors: P, G,
    and the masters plus the optimizer's states under "optim"."""
    state = lins_state(model)
    total = state.unit_memory_bytes()
    total["optim"] += optimizer_state_bytes(state.optimizer)
    return total
