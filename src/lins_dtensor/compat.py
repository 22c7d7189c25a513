"""The private torch APIs Lins uses, each behind one function that names the public API
it waits for. Nothing else in lins_dtensor touches a private torch name.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# The torch releases whose private APIs below match (pyproject's range); 2.13.0 is the
# one the test suite runs on. Outside the range, stop at import with one line rather
# than fail somewhere inside FSDP2.
SUPPORTED_TORCH = ((2, 13), (2, 14))
_found = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if not SUPPORTED_TORCH[0] <= _found <= SUPPORTED_TORCH[1]:
    raise ImportError(
        f"lins_dtensor supports torch 2.13 to 2.14 (tested on 2.13.0); this is torch {torch.__version__}: "
        "install torch==2.13.0"
    )

# Waits for: ``AllGather`` / ``ReduceScatter`` exported from ``torch.distributed.fsdp``
# (the types ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` take).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: F401

# Waits for: a public setter of a process group's timeout (see set_group_timeout).
from torch.distributed.distributed_c10d import _set_pg_timeout

# Waits for: ``torch.utils._pytree`` becoming public (see map_floating_tensors).
from torch.utils._pytree import tree_map_only


def fsdp_unit_params(module: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters FSDP2 manages for ``module``, in the order of its
    all-gather and reduce-scatter buffers.

    Waits for: a public ``FSDPModule`` accessor of its parameter group's parameters."""
    param_group = module._get_fsdp_state()._fsdp_param_group
    return [p.sharded_param for p in param_group.fsdp_params] if param_group else []


def cast_fsdp_params_(module: nn.Module, params: Sequence[nn.Parameter], dtype: torch.dtype) -> None:
    """Store ``params`` (FSDP2's sharded parameters of ``module``) in ``dtype``. They stay
    the same objects, hooks included; FSDP2 re-pads their local shards in its ``_apply``
    and reads their dtype at its lazy init, so call this before the first forward.

    Waits for: a public FSDP2 setter of the sharded parameters' dtype (``module.to(dtype)``
    would cast the buffers and every other unit's parameters too)."""
    ids = {id(p) for p in params}
    module._apply(lambda t: t.to(dtype) if id(t) in ids else t)


def fsdp_wait_all_gather_streams(module: nn.Module, event: torch.Event) -> None:
    """Make the streams FSDP2 copies and all-gathers ``module``'s parameters on wait for
    ``event`` (Lins wrote the parameters' local shards on its own stream).

    Waits for: a per-module ``FSDPModule.set_post_optim_event`` (today it is honoured by
    the root only, which would hold every unit's all-gather until all are updated)."""
    param_group = module._get_fsdp_state()._fsdp_param_group
    if param_group is not None:
        param_group._wait_all_gather_streams_on_event(event)


def fsdp_forward_prefetch_modules(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 starts all-gathering from ``module``'s pre-forward, as set by
    ``FSDPModule.set_modules_to_forward_prefetch``.

    Waits for: a public getter beside that setter."""
    state = module._get_fsdp_state()
    return [m for target in state._states_to_forward_prefetch for m in target._modules]


def rearm_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Make ``param``'s post-accumulate-grad hooks fire again after its contents were
    swapped in place (``torch.utils.swap_tensors``, which ``Module.to_empty`` / ``_apply``
    use for DTensor parameters). The swap leaves the hook dict on the object but not the
    autograd hook that calls it; assigning the dict again installs that hook on the
    current contents. Every hook in the dict is kept (Lins' and anyone else's), and doing
    it when nothing was swapped changes nothing.

    Waits for: ``swap_tensors`` carrying post-accumulate-grad hooks with the tensor, or
    a public re-registration (``Tensor.register_post_accumulate_grad_hook`` adds to the
    stale dict without re-installing it)."""
    hooks = param._post_accumulate_grad_hooks
    if hooks is not None:
        param._post_accumulate_grad_hooks = hooks


def in_backward() -> bool:
    """True inside the autograd engine (FSDP2 re-gathers in backward).

    Waits for: FSDP2 telling a custom all-gather why it gathers."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished (call from a hook
    inside it), as DDP and FSDP2 do for their end-of-backward work.

    Waits for: a public end-of-backward hook (``torch.autograd.graph`` has none)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def chunk_cat(tensors: Sequence[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Chunk each 2-D tensor into ``num_chunks`` row chunks (padding short ones with
    zeros) and write chunk j of every tensor into row j of ``out`` (casting to its dtype).

    Waits for: a public ``torch.chunk_cat`` (FSDP2 uses the same op)."""
    torch._chunk_cat(list(tensors), dim=0, num_chunks=num_chunks, out=out)


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, in one fused call. Waits for: public foreach ops."""
    torch._foreach_copy_(list(dst), list(src))


def foreach_add_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``d.add_(s)`` for each pair, in one fused call. Waits for: public foreach ops."""
    torch._foreach_add_(list(dst), list(src))


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: torch.Tensor | float) -> None:
    """``t.mul_(scalar)`` for each tensor, in one fused call. Waits for: public foreach ops."""
    torch._foreach_mul_(list(tensors), scalar)


def map_floating_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """Apply ``fn`` to every floating-point tensor in a nest of tuples, lists and dicts.

    Waits for: ``torch.utils._pytree`` becoming public (FSDP2 uses it for the same casts)."""
    return tree_map_only(torch.Tensor, lambda t: fn(t) if torch.is_floating_point(t) else t, tree)


def set_group_timeout(group: torch.distributed.ProcessGroup, timeout: datetime.timedelta) -> None:
    """Change how long ``group``'s collectives may wait for a peer before they fail.
    Waits for: a public setter (``new_group(timeout=)`` and DeviceMesh's
    ``backend_override`` only apply at creation; torchtitan uses this same private
    function to move its groups from the start-up to the training timeout)."""
    _set_pg_timeout(timeout, group)
