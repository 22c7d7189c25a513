"""The executor's rules, with stand-in collectives the test completes by hand: each
process group sees the chains in submission order, chains start in submission order
within the byte bound, and waiting blocks only on what is needed."""

from __future__ import annotations

import pytest
import torch

from lins_dtensor.collectives import CommStream, CommTiming
from lins_dtensor.executor import Chain, Executor, Request


class FakeFlight:
    """A collective that completes when the test says so (or when joined)."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name
        self.done = False
        self.timing = CommTiming(name, "optim", 0.0)

    def completed(self) -> bool:
        return self.done

    def join(self) -> None:
        if not self.done:
            self.log.append(f"block:{self.name}")
        self.done = True


class Harness:
    def __init__(self, max_inflight_bytes: int = 1 << 30) -> None:
        self.log: list[str] = []
        self.flights: dict[str, FakeFlight] = {}
        self.executor = Executor(CommStream(torch.device("cpu")), max_inflight_bytes)

    def chain(self, name: str, dims: list[str], nbytes: int = 0) -> Chain:
        def start(label):
            self.log.append(f"issue:{label}")
            self.flights[label] = FakeFlight(self.log, label)
            return self.flights[label]

        def body():
            self.log.append(f"start:{name}")
            for i, dim in enumerate(dims):
                yield Request(dim, lambda label=f"{name}.{i}@{dim}": start(label))
                self.log.append(f"after:{name}.{i}")
            self.log.append(f"end:{name}")

        return self.executor.submit(Chain(name, dims, body(), nbytes))

    def complete(self, label: str) -> None:
        self.flights[label].done = True
        self.executor.pump()

    def issued(self) -> list[str]:
        return [e.split(":", 1)[1] for e in self.log if e.startswith("issue:")]


def test_each_group_sees_the_chains_in_submission_order():
    h = Harness()
    a = h.chain("a", ["intra", "inter"])
    b = h.chain("b", ["intra", "inter"])
    # Both first collectives go out at once: different chains, same group, in order.
    assert h.issued() == ["a.0@intra", "b.0@intra"]
    h.complete("b.0@intra")  # b is ready for its inter collective first...
    assert h.issued() == ["a.0@intra", "b.0@intra"]  # ...but a still owes one on that group
    h.complete("a.0@intra")
    assert h.issued() == ["a.0@intra", "b.0@intra", "a.1@inter", "b.1@inter"]
    h.complete("b.1@inter")
    assert b.done and not a.done  # once issued in order, they may finish in any order
    h.complete("a.1@inter")
    assert a.done and b.done and h.executor.chains == []


def test_chains_on_other_groups_pass_each_other():
    h = Harness()
    slow = h.chain("slow", ["inter"])
    fast = h.chain("fast", ["intra"])
    h.complete("fast.0@intra")
    assert fast.done and not slow.done


def test_chains_start_in_order_within_the_byte_bound():
    h = Harness(max_inflight_bytes=10)
    first = h.chain("first", ["intra"], nbytes=8)
    second = h.chain("second", ["inter"], nbytes=8)  # another group, but over the bound
    third = h.chain("third", ["other"], nbytes=1)  # fits, but may not start before second
    assert h.issued() == ["first.0@intra"] and "start:second" not in h.log and "start:third" not in h.log
    h.complete("first.0@intra")
    assert first.done and h.issued() == ["first.0@intra", "second.0@inter", "third.0@other"]
    assert not second.done and not third.done


def test_a_chain_finishing_frees_its_bytes_within_the_same_pump():
    """The deadlock the bound once had: the running chain finishes inside a pump and the
    next one must start in that same pump, or a wait finds nothing in flight."""
    h = Harness(max_inflight_bytes=10)
    h.chain("first", ["intra"], nbytes=8)
    second = h.chain("second", ["intra"], nbytes=8)
    h.flights["first.0@intra"].done = True
    h.executor.wait(second)  # blocks on second's own collective, never on nothing
    assert second.done and h.log[-2:] == ["after:second.0", "end:second"]
    assert "block:second.0@intra" in h.log


def test_waiting_blocks_only_on_what_the_chain_needs():
    h = Harness()
    ahead = h.chain("ahead", ["inter"])
    mine = h.chain("mine", ["intra", "inter"])
    h.complete("mine.0@intra")
    h.executor.wait(mine)  # its inter collective waits for ahead's: block on that one first
    blocks = [e for e in h.log if e.startswith("block:")]
    assert blocks == ["block:ahead.0@inter", "block:mine.1@inter"] and ahead.done and mine.done


def test_a_chain_that_asks_for_an_undeclared_group_is_refused():
    executor = Executor(CommStream(torch.device("cpu")), 1 << 30)

    def body():
        yield Request("inter", lambda: FakeFlight([], "x"))

    with pytest.raises(RuntimeError, match="declared intra"):
        executor.submit(Chain("bad", ["intra"], body(), 0))
