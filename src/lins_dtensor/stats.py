"""What Lins did in the last step: collectives by state, op and link, and memory per state."""

from __future__ import annotations

import dataclasses

from torch import nn

from lins_dtensor.runtime import lins_state
from lins_dtensor.schedule import CollectiveRecord, summarize


@dataclasses.dataclass(frozen=True)
class LinsStats:
    plan: str
    collectives: list[CollectiveRecord]  # the last completed optimizer step, on this rank
    comm_seconds: float  # host time inside those collectives (launch time on async backends)
    memory_bytes: dict[str, int]  # persistent bytes per state on this rank

    def bytes_by(self, state: str | None = None, op: str | None = None, link: str | None = None, wire: bool = False) -> float:
        """Sum of message (or ring wire) bytes over the records matching the filters."""
        key = "wire_bytes" if wire else "message_bytes"
        return sum(
            v[key]
            for (s, o, lk), v in summarize(self.collectives).items()
            if (state is None or s == state) and (op is None or o == op) and (link is None or lk == link)
        )

    def scalars(self) -> dict[str, float]:
        """Flat ``lins/...`` names for a metrics logger (TensorBoard)."""
        out: dict[str, float] = {}
        for (state, op, link), v in summarize(self.collectives).items():
            out[f"lins/bytes/{state}/{op}/{link}"] = v["message_bytes"]
        out["lins/comm_seconds"] = self.comm_seconds
        for state, nbytes in self.memory_bytes.items():
            out[f"lins/memory/{state}"] = nbytes
        return out


def lins_stats(model: nn.Module) -> LinsStats:
    state = lins_state(model)
    return LinsStats(str(state.plan), list(state.recorder.last_step), state.recorder.last_step_seconds, state.memory_bytes())
