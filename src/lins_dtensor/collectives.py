"""Every collective Lins issues, and the record of each one.

All communication of the runtime goes through the functions here: FSDP2's own
parameter all-gather and gradient reduce-scatter come in through its documented
extension points (:class:`LinsAllGather`, :class:`LinsReduceScatter`), and the
gradient, optimizer and update collectives that FSDP2 cannot express are issued by
:func:`all_gather`, :func:`reduce_scatter` and :func:`all_reduce`. Each call is
recorded with its :class:`~lins_dtensor.schedule.CollectiveSpec`, so the accounting
(:func:`lins_dtensor.lins_stats`) sees exactly what went on the wire, and each runs
inside a profiler range ``lins::<name>``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
# Not re-exported by torch.distributed.fsdp; the module FSDP2 defines them in.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.profiler import record_function

from lins_dtensor.schedule import (
    GRAD_REDUCE_SCATTER,
    PARAM_ALL_GATHER,
    PARAM_REGATHER,
    CollectiveRecord,
    CollectiveSpec,
)


class CommRecorder:
    """Collects the records of one optimizer step; ``last_step`` holds the previous one.

    ``seconds`` is host wall time spent inside the calls; with asynchronous backends
    (NCCL) it measures launch time only, on gloo it is the time to completion.
    """

    def __init__(self, ranks_per_node: int) -> None:
        self.ranks_per_node = ranks_per_node
        self.current: list[CollectiveRecord] = []
        self.last_step: list[CollectiveRecord] = []
        self.seconds = 0.0
        self.last_step_seconds = 0.0
        self._group_info: dict[int, tuple[int, int]] = {}

    def _describe(self, group: dist.ProcessGroup | None) -> tuple[int, int]:
        key = id(group)
        if key not in self._group_info:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            self._group_info[key] = (len(ranks), len({r // self.ranks_per_node for r in ranks}))
        return self._group_info[key]

    def record(self, spec: CollectiveSpec, group: dist.ProcessGroup | None, message: torch.Tensor, seconds: float) -> None:
        size, nodes = self._describe(group)
        nbytes = message.numel() * message.element_size()
        self.current.append(CollectiveRecord(spec.name, spec.state, spec.op, size, nodes, nbytes))
        self.seconds += seconds

    def end_step(self) -> None:
        self.last_step, self.current = self.current, []
        self.last_step_seconds, self.seconds = self.seconds, 0.0


def _timed(recorder: CommRecorder, spec: CollectiveSpec, group, message: torch.Tensor, fn, async_op: bool):
    with record_function(f"lins::{spec.name}"):
        start = time.perf_counter()
        work = fn()
        recorder.record(spec, group, message, 0.0 if async_op else time.perf_counter() - start)
    return work


def all_gather(recorder: CommRecorder, spec: CollectiveSpec, output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    fn = lambda: dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)  # noqa: E731
    return _timed(recorder, spec, group, output, fn, async_op)


def reduce_scatter(recorder: CommRecorder, spec: CollectiveSpec, output: torch.Tensor, input: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    fn = lambda: dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)  # noqa: E731
    return _timed(recorder, spec, group, input, fn, async_op)


def all_reduce(recorder: CommRecorder, spec: CollectiveSpec, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    fn = lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op)  # noqa: E731
    return _timed(recorder, spec, group, tensor, fn, async_op)


def _in_backward() -> bool:
    # FSDP2 does not tell a comm hook why it gathers; inside the autograd engine the
    # graph task id is set, which separates the backward re-gather from forward.
    return torch._C._current_graph_task_id() != -1


class LinsAllGather(AllGather):
    """FSDP2's parameter all-gather, recorded (FSDP2 ``set_custom_all_gather``)."""

    def __init__(self, recorder: CommRecorder) -> None:
        self.recorder = recorder

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        spec = PARAM_REGATHER if _in_backward() else PARAM_ALL_GATHER
        return all_gather(self.recorder, spec, output_tensor, input_tensor, group, async_op)


class LinsReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter over the P group, recorded (``set_custom_reduce_scatter``)."""

    def __init__(self, recorder: CommRecorder) -> None:
        self.recorder = recorder

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return reduce_scatter(self.recorder, GRAD_REDUCE_SCATTER, output_tensor, input_tensor, group, op, async_op)
