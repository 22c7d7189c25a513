"""Lins for torchtitan 0.3, without forking it.

torchtitan 0.3 configures a job with a Python function returning a typed
``Trainer.Config`` (``--module <package> --config <function>``, fields overridden as
``--section.field value``). This package is such a module: its
:mod:`.config_registry` returns :class:`.trainer.LinsTrainer` configs, whose ``lins``
field holds the Lins settings::

    torchrun --nproc_per_node 8 -m lins_dtensor.integrations.torchtitan03.train \\
        --config llama3_8b --lins.plan auto

Importing it installs, where needed, the CPU/gloo shims (:mod:`.cpu`) and the
process-group timeout setter torch 2.13 lacks (:mod:`.timeouts`), and registers the
offline ``python_stdlib`` dataset. The modules, one job each, adapting
:mod:`lins_dtensor.integrations.titan_common` (shared with the 0.2.2 integration):

- ``config_registry``: the job configs;  ``trainer``: ``LinsTrainer`` and its ``Config``;
- ``job``: the config as a ``TitanJob`` (and the settings Lins refuses);
- ``parallelize``: the ``parallelize_fn``;  ``tp``: TP on the Lins mesh;
- ``optimizer``, ``metrics``: the Lins container and metrics processor configs;
- ``cpu``, ``timeouts``: shims;  ``train``: the launcher (one-line errors).
"""

from lins_dtensor.integrations.titan_common.assets import register_dataset
from lins_dtensor.integrations.torchtitan03 import cpu, timeouts

cpu.install()
timeouts.install()
register_dataset()
