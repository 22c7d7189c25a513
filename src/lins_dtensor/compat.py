"""The private torch APIs Lins uses, each behind one function that names the public API
it waits for, and the differences between the torch releases Lins supports. Nothing
else in lins_dtensor asks which torch it runs on or touches a private torch name, with
one exception: :class:`lins_dtensor.units.ReplicatedParams` reads ``nn.Module._parameters``
to find the module attribute that holds each parameter (torch has no public lookup of
it; ``named_parameters`` gives names, not the slot to watch for a replaced Parameter).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lins_dtensor.errors import LinsUsageError

# The torch releases whose private APIs below match (pyproject's range,
# scripts/test_torch_versions.sh); 2.13.0 is the one the test suite runs on. Outside the
# range, stop at import with one line rather than fail somewhere inside FSDP2.
SUPPORTED_TORCH = ((2, 11), (2, 15))
_found = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if not SUPPORTED_TORCH[0] <= _found <= SUPPORTED_TORCH[1]:
    _lo, _hi = (".".join(map(str, end)) for end in SUPPORTED_TORCH)
    raise ImportError(
        f"lins_dtensor supports torch {_lo} to {_hi} (tested on 2.13.0); this is torch {torch.__version__}: "
        "install torch==2.13.0"
    )

# Waits for: ``AllGather`` / ``ReduceScatter`` exported from ``torch.distributed.fsdp``
# (the types ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` take).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: F401

# Waits for: a public setter of a process group's timeout (see set_group_timeout).
from torch.distributed.distributed_c10d import _set_pg_timeout

# Waits for: ``torch.utils._pytree`` becoming public (see map_floating_tensors).
from torch.utils._pytree import tree_leaves, tree_map_only


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


def fsdp_reduce_scatter_unused_params(module: nn.Module) -> None:
    """Make FSDP2 reduce a zero gradient for each of ``module``'s parameters that got
    none in a backward, so that every reduce-scatter holds all of its parameters.

    torch 2.13 has ``FSDPModule.set_reduce_scatter_unused_params``. Before it, FSDP2's
    post-backward reduces only the parameters with a gradient, and the reduce-scatter
    shrinks; this gives the others, just before that post-backward reads them, the zero
    gradient 2.13 gives (under the same conditions: the group reduces, the parameter
    requires a gradient and has none, accumulated or not).

    Waits for: ``FSDPModule.set_reduce_scatter_unused_params`` (torch 2.13) in every
    supported release."""
    if hasattr(module, "set_reduce_scatter_unused_params"):
        module.set_reduce_scatter_unused_params(True, recurse=False)
        return
    param_group = module._get_fsdp_state()._fsdp_param_group
    if param_group is None:
        return
    post_backward = param_group.post_backward

    def post_backward_with_unused(*args: Any) -> None:
        if param_group.reduce_grads:
            for fsdp_param in param_group.fsdp_params:
                if not hasattr(fsdp_param, "_unsharded_param"):  # never gathered
                    continue
                param = fsdp_param.unsharded_param
                if param.requires_grad and param.grad is None and fsdp_param.unsharded_accumulated_grad is None:
                    param.grad = torch.zeros_like(param)
        post_backward(*args)

    # FSDP2 calls it through the instance (its autograd function and root callback).
    param_group.post_backward = post_backward_with_unused


def fsdp_report_param_use(module: nn.Module, on_use: Callable[[list[bool]], None]) -> None:
    """Call ``on_use`` with which of ``module``'s parameters (:func:`fsdp_unit_params`'
    order) got a gradient in a backward, just before FSDP2's post-backward reduces them:
    it reduces zeros for the others (:func:`fsdp_reduce_scatter_unused_params`), which
    Lins must tell apart from a gradient. Install it after that function.

    Waits for: a public report of the parameters FSDP2's post-backward found without a
    gradient."""
    param_group = module._get_fsdp_state()._fsdp_param_group
    if param_group is None:
        return
    post_backward = param_group.post_backward

    def post_backward_reporting_use(*args: Any) -> None:
        if param_group.reduce_grads:
            on_use([
                hasattr(fsdp_param, "_unsharded_param")
                and (fsdp_param.unsharded_accumulated_grad is not None or fsdp_param.unsharded_param.grad is not None)
                for fsdp_param in param_group.fsdp_params
            ])
        post_backward(*args)

    param_group.post_backward = post_backward_reporting_use  # called through the instance


def fsdp_reset_iter_state(root: nn.Module) -> None:
    """Recover FSDP2 after a forward or backward that raised: wait for its collectives in
    flight, reshard, and clear its per-iteration state (the failed iteration's gradients
    are discarded). ``root``: the module the outermost ``fully_shard`` was applied to.

    Waits for: ``FSDPModule.reset_iter_state`` (torch 2.13) in every supported release."""
    if not hasattr(root, "reset_iter_state"):
        raise LinsUsageError(
            f"recovering from a step that raised needs FSDPModule.reset_iter_state (torch >= 2.13) where P is "
            f"sharded; this is torch {torch.__version__}: restart from the last checkpoint instead"
        )
    root.reset_iter_state()


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


class _HeldElsewhere(torch.Tensor):
    """A gradient that holds no data and refuses every op with one line (see
    :func:`gradient_held_elsewhere`)."""

    message: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, message: str) -> "_HeldElsewhere":
        grad = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        grad.message = message
        return grad

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        message = next(a.message for a in tree_leaves((args, kwargs)) if isinstance(a, _HeldElsewhere))
        raise RuntimeError(message)

    def __repr__(self) -> str:
        return f"<gradient held elsewhere: {self.message}>"


def gradient_held_elsewhere(param: torch.Tensor, message: str) -> torch.Tensor:
    """A ``.grad`` for ``param`` that costs no memory and raises ``RuntimeError(message)``
    in any op that reads it (``torch.nn.utils.clip_grad_norm_``, a norm for logging, an
    accumulation), so that code reading ``p.grad`` fails loudly instead of seeing None.

    Waits for: a public way to mark a parameter's gradient as kept elsewhere
    (``Tensor._make_wrapper_subclass`` is what torch's own subclasses use)."""
    return _HeldElsewhere(param, message)


def fsdp_unshard_async_op(module: nn.Module) -> bool:
    """Whether FSDP2 unshards ``module`` asynchronously, copying in and all-gathering on
    the caller's current stream instead of its own (``FSDPModule._set_unshard_async_op``).

    Waits for: a public getter (and setter) of FSDP2's asynchronous unshard."""
    param_group = module._get_fsdp_state()._fsdp_param_group
    return bool(param_group is not None and param_group.unshard_async_op)


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


# torch 2.13 renamed the single-tensor collectives to ``*_single`` and deprecated the old
# names (a FutureWarning at every call); before 2.13 only the old names exist. Same
# arguments, same collective.
if hasattr(dist, "all_gather_single"):
    all_gather_single, reduce_scatter_single = dist.all_gather_single, dist.reduce_scatter_single
else:
    all_gather_single, reduce_scatter_single = dist.all_gather_into_tensor, dist.reduce_scatter_tensor


def set_group_timeout(group: torch.distributed.ProcessGroup, timeout: datetime.timedelta) -> None:
    """Change how long ``group``'s collectives may wait for a peer before they fail.
    Waits for: a public setter (``new_group(timeout=)`` and DeviceMesh's
    ``backend_override`` only apply at creation; torchtitan uses this same private
    function to move its groups from the start-up to the training timeout)."""
    _set_pg_timeout(timeout, group)


def keep_own_state_dict(optimizer: torch.optim.Optimizer, state_dict: Callable[[], dict]) -> None:
    """Make ``state_dict`` what ``optimizer.state_dict()`` returns (an instance attribute),
    while ``torch.distributed.checkpoint.state_dict`` keeps calling the class's
    ``Optimizer.state_dict``, whose parameter ids it maps to FQNs itself: the registry
    of bypassed callables that torch's own ``_patch_optimizer_state_dict`` fills.

    Waits for: a public way for an optimizer to offer its users a state dict of its own
    (keyed by FQN) that torch's state-dict API does not read in place of the class's."""
    from torch.distributed.checkpoint.state_dict import _patched_state_dict

    optimizer.state_dict = state_dict
    _patched_state_dict.add(state_dict)
