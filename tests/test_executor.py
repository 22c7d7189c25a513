"""The executor's rules, with stand-in collectives the test completes by hand: each
process group sees the chains in submission order, chains start in submission order
within the byte bound, and waiting blocks only on what is needed."""

from __future__ import annotations

import pytest
import torch

from fake_device import FakeDevice
from lins_dtensor import executor as executor_module
from lins_dtensor.collectives import CommStream, CommTiming
from lins_dtensor.executor import Chain, Executor, Request
from lins_dtensor.stats import LinsStats

pytestmark = pytest.mark.quick  # in one process


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


# ----- at exit --------------------------------------------------------------------------
@pytest.fixture
def at_exit(monkeypatch):
    """finish_at_exit over the executors given, with the collectives' own wait and
    os._exit stood in for; returns what happened, in order. ``issued`` (a function) is
    what had been issued when the collectives' wait began. The process leaves normally
    (no ``sys.last_value``) unless a test sets one."""
    monkeypatch.delattr("sys.last_value", raising=False)
    ended: list[str] = []
    seen = {"issued": lambda: []}
    monkeypatch.setattr(executor_module, "finish_in_flight_at_exit",
                        lambda: ended.append(f"flights waited after {seen['issued']()}"))

    def end(message: str) -> None:
        ended.append(message)
        raise _Ended

    monkeypatch.setattr(executor_module, "end_process_now", end)

    def run(*executors: Executor, issued=lambda: []) -> list[str]:
        seen["issued"] = issued
        monkeypatch.setattr(executor_module, "_WITH_CHAINS_LEFT", dict.fromkeys(e for e in executors if e.chains))
        try:
            executor_module.finish_at_exit()
        except _Ended:
            pass
        return ended

    return run


class _Ended(Exception):
    """``os._exit`` in the tests: the hook stops where the process would have ended."""


def test_at_exit_every_chain_issues_what_it_has_left_before_the_collectives_are_waited_for(at_exit):
    """A rank leaving after its last step with a gather over the node not yet issued
    (the one across the nodes still running) would leave its peers waiting in theirs:
    at exit the chain runs to its end, then the running collectives are waited for."""
    h = Harness()
    update = h.chain("update", ["inter", "intra"])
    assert h.issued() == ["update.0@inter"]
    assert at_exit(h.executor, issued=h.issued) == ["flights waited after ['update.0@inter', 'update.1@intra']"]
    assert update.done


def test_at_exit_a_rank_that_left_mid_step_issues_nothing_more(at_exit):
    """Its peers wait elsewhere (in a collective of the step it left), and would never
    issue the rest: issuing it would only hang this rank until the timeout."""
    h = Harness()
    h.chain("update", ["inter", "intra"])
    h.executor.drain_at_exit = lambda: False
    assert at_exit(h.executor, issued=h.issued) == ["flights waited after ['update.0@inter']"]


def test_at_exit_on_a_device_nothing_is_left_to_issue(at_exit):
    h = DeviceHarness()
    h.chain("update", ["inter", "intra"])
    issued = [e for e in h.log if e.startswith("issue:")]
    assert issued == ["issue:update.0@inter", "issue:update.1@intra"]  # at submission
    assert at_exit(h.executor) == ["flights waited after []"] and [e for e in h.log if e.startswith("issue:")] == issued


def test_at_exit_on_an_uncaught_exception_no_chain_issues_more(at_exit, monkeypatch):
    monkeypatch.setattr("sys.last_value", ValueError("a step failed"), raising=False)
    h = Harness()
    h.chain("update", ["inter", "intra"])
    # The collectives' wait then ends the rank at once (test_collectives).
    assert at_exit(h.executor, issued=h.issued) == ["flights waited after ['update.0@inter']"]


class LostPeer(FakeFlight):
    def join(self) -> None:
        raise RuntimeError("lins: collective update_gather_grad (optim) failed: Connection closed by peer")


def _update_after_a_lost_peer(log: list) -> Chain:
    def body():
        yield Request("inter", lambda: LostPeer(log, "x"))
        yield Request("intra", lambda: log.append("issue:intra") or FakeFlight(log, "y"))

    return Chain("update", ["inter", "intra"], body(), 0)


def test_at_exit_a_chain_that_fails_is_named_and_ends_the_rank(at_exit):
    executor = Executor(CommStream(torch.device("cpu")), 1 << 30)
    executor.submit(_update_after_a_lost_peer([]))
    assert at_exit(executor) == ["lins: collective update_gather_grad (optim) failed: Connection closed by peer (at exit)"]


def test_after_a_failed_collective_the_exit_issues_nothing_more(at_exit):
    """The program saw the failure (and may have caught it): the groups cannot be
    trusted, so the exit neither retries the collective nor issues the rest."""
    executor, log = Executor(CommStream(torch.device("cpu")), 1 << 30), []
    chain = executor.submit(_update_after_a_lost_peer(log))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        executor.wait(chain)
    assert at_exit(executor) == ["flights waited after []"] and log == []


def test_after_a_collective_failed_to_start_the_exit_issues_nothing_more(at_exit):
    executor, starts = Executor(CommStream(torch.device("cpu")), 1 << 30), []

    def refused():
        starts.append("start")
        raise RuntimeError("lins: collective update_gather_grad (optim) failed: Connection reset by peer")

    def body():
        yield Request("intra", refused)

    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        executor.submit(Chain("update", ["intra"], body(), 0))
    assert at_exit(executor) == ["flights waited after []"] and starts == ["start"]


def test_an_executor_with_chains_left_is_held_until_they_are_done():
    """A model freed before exit still issues its rest there."""
    h = Harness()
    h.chain("update", ["inter"])
    assert h.executor in executor_module._WITH_CHAINS_LEFT
    h.complete("update.0@inter")
    assert h.executor not in executor_module._WITH_CHAINS_LEFT


# ----- on a device: the same executor over fake_device's streams and events ----------------
class DeviceFlight:
    """A collective enqueued on the side stream: joining it is a stream wait, which the
    host never blocks on."""

    def __init__(self, log: list, name: str, stream: CommStream) -> None:
        self.log, self.name, self.stream = log, name, stream
        self.timing = CommTiming(name, "optim", 0.0)
        self.timing.start_event = stream.event_on_side(timing=True)

    def completed(self) -> bool:
        return True  # the side stream orders what follows

    def join(self) -> None:
        self.log.append(f"stream-wait:{self.name}")
        self.timing.end_event = self.stream.event_on_side(timing=True)


class DeviceHarness:
    def __init__(self, max_inflight_bytes: int = 1 << 30) -> None:
        self.device = FakeDevice()
        self.stream = CommStream(torch.device("cpu"), streams=self.device)
        self.executor = Executor(self.stream, max_inflight_bytes)
        self.log: list[str] = []

    def chain(self, name: str, dims: list[str], input_bytes: int = 0) -> Chain:
        def body():
            self.log.append(f"start:{name}")
            for i, dim in enumerate(dims):
                label = f"{name}.{i}@{dim}"
                yield Request(dim, lambda label=label: self.log.append(f"issue:{label}") or DeviceFlight(self.log, label, self.stream))
            self.log.append(f"end:{name}")

        inputs = (torch.zeros(input_bytes, dtype=torch.uint8),) if input_bytes else ()
        return self.executor.submit(Chain(name, dims, body(), 0, inputs=inputs))


def test_on_a_device_chains_are_enqueued_whole_and_the_host_never_waits():
    """Finding 1 of the GPU read-through: with chains over the byte bound the host used to
    defer them until an event query said the device was done, and wait() synchronised
    (checked against the old executor.py: the second chain was not issued at submission)."""
    h = DeviceHarness(max_inflight_bytes=10)
    first = h.chain("first", ["intra", "inter"], input_bytes=8)
    second = h.chain("second", ["inter"], input_bytes=8)  # over the bound with first
    third = h.chain("third", ["intra"], input_bytes=1)
    update = h.chain("update", ["intra"])  # side-stream buffers only: never makes anyone wait
    # Everything is on the side stream at submission, each group in submission order.
    assert [e for e in h.log if e.startswith("issue:")] == ["issue:first.0@intra", "issue:first.1@inter", "issue:second.0@inter",
                                                           "issue:third.0@intra", "issue:update.0@intra"]
    assert all(c.done for c in (first, second, third, update)) and h.executor.chains == []
    # The bound holds the inputs: first's were released once the stream that made them
    # had waited for first's end, the host going on; the others are still held.
    assert first.inputs == () and h.device.current.has_waited_for(first.end_event)
    assert h.executor.holding == [second, third] and second.inputs and third.inputs
    assert not h.device.current.has_waited_for(second.end_event)
    # Chains wait for their submitter's stream before their first step.
    assert all(h.stream.stream.has_waited_for(c.ready_event) for c in (first, second, third, update))
    h.executor.wait(second)
    assert h.device.current.has_waited_for(second.end_event) and not h.device.current.has_waited_for(third.end_event)
    h.executor.wait_all()
    assert h.device.current.has_waited_for(update.end_event) and h.executor.holding == [] and third.inputs == ()
    assert h.device.host_syncs == 0
    # Ordering-only events carry no timestamp; the collectives' own are timed.
    assert not any(e.timing for c in (first, second, third) for e in (c.ready_event, c.end_event))
    assert all(t.start_event.timing and t.end_event.timing for c in (first, second, third) for t in c.timings)


def test_on_a_device_a_timing_is_read_once_all_its_events_completed():
    """Finding 2: lins_stats read the exposed time from the consumer's event after
    synchronising only the collective's end, and torch refuses elapsed_time on an event
    not yet completed; a later wait replaced the consumer's event with one long after the
    end, so the exposed time read ~0 (checked against the old executor.py: the event
    was replaced). lins_stats(wait=False) must not synchronise: a timing not complete
    yet counts as unmeasured."""
    h = DeviceHarness()
    chain = h.chain("grads", ["inter"])
    h.executor.wait(chain)  # the consumer needs it: exposed from here to the end
    first_need = chain.timings[0].need_event
    h.executor.wait(chain)  # the next step's first accumulate waits for it again
    timing = chain.timings[0]
    assert timing.need_event is first_need
    timing.start_event.completes_at, first_need.completes_at, timing.end_event.completes_at = 0.0, 4.0, 10.0
    h.device.run(through=timing.end_event.seq)  # the consumer's event (recorded later) is still pending
    assert first_need.time is None
    unwaited = LinsStats("p", [], [timing], {}, blocking=False).comm_time()
    assert unwaited == {"optim": {"exposed": 0.0, "hidden": 0.0, "unmeasured": 1}} and h.device.host_syncs == 0
    comm = LinsStats("p", [], [timing], {}).comm_time()
    assert comm["optim"]["exposed"] == pytest.approx(0.006) and comm["optim"]["hidden"] == pytest.approx(0.004)
    assert comm["optim"]["unmeasured"] == 0 and timing.seconds == pytest.approx(0.010)
