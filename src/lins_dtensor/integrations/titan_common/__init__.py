"""What Lins' torchtitan integrations share, whichever torchtitan release they plug into.

``lins_dtensor.integrations.torchtitan`` (0.2.2, TOML) and
``lins_dtensor.integrations.torchtitan03`` (0.3, typed Python configs) each adapt their
release's config and extension points; below that layer everything is here, one job
per module:

- ``settings``: the ``lins`` settings dataclass;  ``job``: the release-neutral view of a job;
- ``plan``: validation and plan resolution;  ``planning``: the planner and the start-up table;
- ``optimizer``: the Lins optimizer container's behaviour (clipping, FQN-keyed state);
- ``clipping``: routing torchtitan's clipping call to Lins;
- ``metrics``: the ``lins/*`` TensorBoard scalars;  ``assets``: offline tokenizer and corpus.
"""
