"""The ``[lins]`` section of a torchtitan 0.2.2 job config.

Point torchtitan at this module with ``[job] custom_config_module =
"lins_dtensor.integrations.torchtitan.config"``: torchtitan merges the ``JobConfig``
dataclass below into its own, so ``[lins]`` keys
(:class:`~lins_dtensor.integrations.titan_common.settings.Lins`) can be set in the TOML
file or on the command line (``--lins.plan zero2``).
"""

from dataclasses import dataclass, field

from lins_dtensor.integrations.titan_common.settings import Lins


@dataclass
class JobConfig:
    lins: Lins = field(default_factory=Lins)
