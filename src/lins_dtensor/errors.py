"""The errors Lins raises for input it cannot take, one class per kind of fault.

Every message is one line that starts with :data:`PREFIX` and names the setting, the
value and the rule; the base class adds the prefix, so a raise site writes only the
rule, and :attr:`LinsError.detail` gives the message without it for embedding in
another one (a ``[lins]`` config error that quotes a plan error says ``lins:`` once)::

    LinsError (ValueError)
    +-- LinsPlanError        a plan breaks a rule for this cluster (parse, validate, mesh)
    +-- LinsUsageError       an API called with arguments or in a state Lins cannot take
    |   +-- LinsConfigError  a torchtitan ``[lins]`` value (the message names the key)
    +-- LinsCheckpointError  a state dict that does not match the model or optimizer
    +-- PlannerError         planner input: a model, cluster or file it cannot cost

All derive from ``ValueError`` because ``LinsPlanError``, once raised for all of these,
did. The usage and checkpoint errors do not derive from ``LinsPlanError``: the code that
catches it (the planner, the torchtitan plan check) catches plan rules only, and a
program that caught it around ``apply_lins`` or a checkpoint load should catch
:class:`LinsError`. Internal invariants that only a Lins bug can break, collective
failures and a non-finite clipping norm (``RuntimeError`` in torch too) stay
``RuntimeError``, with the same prefix.

This module imports nothing from Lins: every other module may import it.
"""

from __future__ import annotations

PREFIX = "lins: "


class LinsError(ValueError):
    """Input Lins cannot take; ``str()`` is ``lins: <detail>``, one line."""

    def __init__(self, detail: str) -> None:
        # removeprefix: an unpickled error (spawned ranks send theirs back) is built
        # again from its full message.
        self.detail = detail.removeprefix(PREFIX)
        super().__init__(PREFIX + self.detail)


class LinsPlanError(LinsError):
    """A plan that breaks a rule for this cluster shape; the message names the rule."""


class LinsUsageError(LinsError):
    """An API called with a value, a model or in an order Lins cannot take."""


class LinsConfigError(LinsUsageError):
    """A torchtitan ``[lins]`` (or related section's) value Lins cannot run with."""


class LinsCheckpointError(LinsError):
    """A model or optimizer state dict that does not match what Lins holds."""


class PlannerError(LinsError):
    """Planner input it cannot cost: unknown preset, impossible cluster, nothing fits."""
