"""torchtitan 0.2.2's tokenizer builder with Lins' offline assets
(:mod:`lins_dtensor.integrations.titan_common.assets`) created first when asked to."""

from __future__ import annotations

from torchtitan.protocols.train_spec import get_train_spec

from lins_dtensor.integrations.titan_common.assets import DATASET_NAME, prepare


def build_tokenizer(job_config, build_hf_tokenizer):
    """TrainSpec tokenizer builder: create the offline assets first when asked to."""
    assets = job_config.model.hf_assets_path
    prepare(getattr(job_config, "lins", None), assets, _model_vocab_size(job_config))
    if job_config.training.dataset == DATASET_NAME and not job_config.training.dataset_path:
        job_config.training.dataset_path = assets
    return build_hf_tokenizer(job_config)


def _model_vocab_size(job_config) -> int:
    try:
        args = get_train_spec(job_config.model.name).model_args[job_config.model.flavor]
        return int(getattr(args, "vocab_size", 2048))
    except (KeyError, ValueError):
        return 2048
