"""The sharding plan: one factor per model state, and the rules a plan must obey.

A plan says over how many data-parallel ranks each model state is sharded:
``params`` (s_p), ``grads`` (s_g) and ``optim`` (s_os). Every group is a run of
consecutive ranks, so the rules below make a group either stay inside one node or
cover whole nodes ("fill a node before spanning nodes", as in the Lins paper).
"""

from __future__ import annotations

import dataclasses
import re

from lins_dtensor.errors import LinsPlanError

STATES = ("params", "grads", "optim")

_TEXT_KEYS = {"p": "params", "g": "grads", "os": "optim", "hpz": "reshard_after_forward"}


@dataclasses.dataclass(frozen=True)
class LinsPlan:
    """Sharding factors s_p | s_g | s_os of the three model states.

    Attributes:
        params (int): s_p, the data-parallel ranks each parameter (P) is sharded over.
        grads (int): s_g, the same for gradients (G); a multiple of ``params``.
        optim (int): s_os, the same for masters and optimizer states (OS); a multiple of
            ``grads``.
        reshard_after_forward (bool | int): FSDP2's option: ``True`` frees gathered
            parameters after forward, ``False`` keeps them until backward, and an int
            ``k`` keeps them sharded over ``k`` ranks in between (ZeRO++ hpZ).
    """

    params: int
    grads: int
    optim: int
    reshard_after_forward: bool | int = True

    # ----- construction -------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, world_size: int | None = None) -> "LinsPlan":
        """Parse ``"p=4,g=4,os=8"`` (optionally ``",hpz=2"``) or a preset name.

        Presets (N is ``world_size``): ``ddp`` (1,1,1), ``zero1`` (1,1,N), ``zero2``
        (1,N,N), ``zero3``/``fsdp`` (N,N,N), ``hsdp:k``/``mics:k`` (k,k,k) and
        ``hpz:k`` (N,N,N) with parameters re-sharded to k ranks after forward.

        Args:
            text (str): the plan text or preset name (case and spaces ignored).
            world_size (int | None): N, the data-parallel ranks; presets need it.
        """
        spec = text.strip().lower()
        name, _, arg = spec.partition(":")
        if name in _PRESETS:
            if world_size is None:
                raise LinsPlanError(f"plan preset '{text}' needs world_size to resolve N")
            if bool(arg) != (name in _SIZED_PRESETS):
                form = f"{name}:<k>" if name in _SIZED_PRESETS else name
                raise LinsPlanError(f"plan preset '{text}' must be written '{form}'")
            k = _parse_int(arg, f"plan '{text}'") if arg else 0
            return _PRESETS[name](world_size, k)
        fields: dict[str, int | bool] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in _TEXT_KEYS:
                raise LinsPlanError(
                    f"plan '{text}': expected 'p=<s_p>,g=<s_g>,os=<s_os>[,hpz=<k>]' or one of "
                    f"the presets {sorted(_PRESETS)}, got '{item}'"
                )
            fields[_TEXT_KEYS[key.strip()]] = _parse_int(value, f"plan '{text}' key '{key}'")
        missing = [k for k in ("p", "g", "os") if _TEXT_KEYS[k] not in fields]
        if missing:
            raise LinsPlanError(f"plan '{text}' is missing {', '.join(missing)} (form 'p=..,g=..,os=..')")
        return cls(**fields)  # type: ignore[arg-type]

    def __str__(self) -> str:
        text = f"p={self.params},g={self.grads},os={self.optim}"
        if not isinstance(self.reshard_after_forward, bool):
            text += f",hpz={self.reshard_after_forward}"
        return text

    # ----- the rules ----------------------------------------------------------------
    def validate(self, world_size: int, ranks_per_node: int, tp: int = 1) -> None:
        """Raise :class:`LinsPlanError` naming the first rule this plan breaks.

        The factors count data-parallel ranks: with tensor parallelism of degree ``tp``
        (groups of ``tp`` consecutive ranks inside a node), ``world_size`` and
        ``ranks_per_node`` are the data-parallel ranks of the job and of one node, the
        job's and node's ranks divided by ``tp``; the messages say so.

        Args:
            world_size (int): data-parallel ranks of the job.
            ranks_per_node (int): data-parallel ranks of one node.
            tp (int): the tensor-parallel degree next to them.
        """
        world_text = f"world_size={world_size}" if tp == 1 else f"the {world_size} data-parallel ranks (world_size / tp={tp})"
        node_text = f"ranks_per_node={ranks_per_node}" if tp == 1 else f"the {ranks_per_node} data-parallel ranks per node (ranks_per_node / tp={tp})"
        if world_size < 1:
            raise LinsPlanError(f"world_size={world_size} must be >= 1")
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise LinsPlanError(f"{node_text} must be >= 1 and divide {world_text}")
        for state in STATES:
            value = getattr(self, state)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LinsPlanError(f"{state}={value!r} must be a positive integer sharding factor")
        if world_size % self.optim:
            raise LinsPlanError(f"optim={self.optim} must divide {world_text}")
        if self.grads % self.params or self.optim % self.grads:
            raise LinsPlanError(
                f"factors must nest, params | grads | optim: got params={self.params}, "
                f"grads={self.grads}, optim={self.optim}"
            )
        for state in STATES:
            value = getattr(self, state)
            if ranks_per_node % value and value % ranks_per_node:
                raise LinsPlanError(
                    f"{state}={value} must divide {node_text} or be a multiple "
                    "of it (a group fills a node before it spans nodes)"
                )
        hpz = self.reshard_after_forward
        if not isinstance(hpz, bool):
            if not isinstance(hpz, int) or hpz < 2 or self.params % hpz or hpz == self.params:
                raise LinsPlanError(
                    f"reshard_after_forward={hpz!r} must be True, False or an int k with "
                    f"1 < k < params={self.params} and k dividing params"
                )
            if ranks_per_node % hpz and hpz % ranks_per_node:
                raise LinsPlanError(
                    f"reshard_after_forward={hpz} must divide {node_text} "
                    "or be a multiple of it (a group fills a node before it spans nodes)"
                )
            if tp > 1:
                raise LinsPlanError(
                    f"reshard_after_forward={hpz} (hpZ) with tp={tp}: FSDP2 cannot re-shard tensor-parallel "
                    "(DTensor) parameters to a smaller group after forward; use hpZ without tensor parallelism"
                )
            if self.params != world_size:
                # FSDP2 builds the re-shard groups from the parameter group's ranks only;
                # with several parameter groups those group creations deadlock.
                raise LinsPlanError(
                    f"reshard_after_forward={hpz} needs params == {world_text} "
                    f"(got params={self.params}): hpZ re-sharding works with full parameter sharding only"
                )

    def split(self, ranks_per_node: int) -> dict[str, tuple[int, int]]:
        """Each factor as (ranks inside a node, nodes spanned), the paper's s0 x s1."""
        return {
            state: (min(getattr(self, state), ranks_per_node), max(1, getattr(self, state) // ranks_per_node))
            for state in STATES
        }


def _parse_int(text: str, what: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", text):
        raise LinsPlanError(f"{what}: '{text}' is not a positive integer")
    return int(text)


_SIZED_PRESETS = {"hsdp", "mics", "hpz"}
_PRESETS = {
    "ddp": lambda n, k: LinsPlan(1, 1, 1),
    "zero1": lambda n, k: LinsPlan(1, 1, n),
    "zero2": lambda n, k: LinsPlan(1, n, n),
    "zero3": lambda n, k: LinsPlan(n, n, n),
    "fsdp": lambda n, k: LinsPlan(n, n, n),
    "hsdp": lambda n, k: LinsPlan(k, k, k),
    "mics": lambda n, k: LinsPlan(k, k, k),
    "hpz": lambda n, k: LinsPlan(n, n, n, reshard_after_forward=k),
}
PRESET_NAMES = tuple(sorted(_PRESETS))


def valid_plans(world_size: int, ranks_per_node: int, *, with_hpz: bool = False, tp: int = 1) -> list[LinsPlan]:
    """Every plan that :meth:`LinsPlan.validate` accepts for this cluster shape.

    Args:
        world_size (int): data-parallel ranks of the job.
        ranks_per_node (int): data-parallel ranks of one node.
        with_hpz (bool): also the hpZ variants (``reshard_after_forward=k``).
        tp (int): the tensor-parallel degree next to them.
    """
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    plans = []
    for p in divisors:
        for g in divisors:
            for os_ in divisors:
                hpz_options: list[bool | int] = [True]
                if with_hpz:
                    hpz_options += [k for k in range(2, p) if p % k == 0]
                for hpz in hpz_options:
                    plan = LinsPlan(p, g, os_, hpz)
                    try:
                        plan.validate(world_size, ranks_per_node, tp)
                    except LinsPlanError:
                        continue
                    plans.append(plan)
    return plans
