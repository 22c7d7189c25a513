"""Lins checkpoints in torchtitan 0.3's stock layout (``wq``/``wk``/``wv``, not ``wqkv``).

0.3's fused QKV projection (``FusedQKVLinear``) keeps one ``wqkv`` parameter but saves
and loads it as the stock ``wq``/``wk``/``wv`` entries through its own state-dict
hooks, so that checkpoints (seed checkpoints, torchtitan's FSDP runs, the HF adapter)
do not depend on the fusion. Under Lins the root module's hooks
(:func:`lins_dtensor.apply_lins`) put the masters into the state dict under the
parameter FQNs: on save after the submodules' hooks ran, on load before they run. So
the same split is applied to the master after Lins' save hook (:func:`split_after_lins`,
registered after ``apply_lins``) and the same merge before Lins' load hook
(:func:`merge_before_lins`, registered before it): checkpoints hold the masters in the
stock layout and load from it. Private: ``FusedQKVLinear._split_qkv_on_save`` /
``_merge_qkv_on_load`` (the layout's one definition). Waits for: a public layout
conversion in torchtitan's state-dict adapters.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torchtitan.models.common.attention import FusedQKVLinear

from lins_dtensor.runtime import _clean_fqn


def _fused(model: nn.Module, prefix: str) -> Iterator[tuple[str, FusedQKVLinear]]:
    """Each fused projection with its state-dict prefix (wrappers such as activation
    checkpointing's left out, as in the state dict's keys)."""
    for name, module in model.named_modules():
        if isinstance(module, FusedQKVLinear):
            yield f"{prefix}{_clean_fqn(name)}.", module


def merge_before_lins(model: nn.Module) -> None:
    def merge(module, state_dict, prefix, *args) -> None:
        for sub_prefix, fused in _fused(module, prefix):
            FusedQKVLinear._merge_qkv_on_load(fused, state_dict, sub_prefix)

    model.register_load_state_dict_pre_hook(merge)


def split_after_lins(model: nn.Module) -> None:
    def split(module, state_dict, prefix, local_metadata) -> None:
        for sub_prefix, fused in _fused(module, prefix):
            FusedQKVLinear._split_qkv_on_save(fused, state_dict, sub_prefix, local_metadata)

    model.register_state_dict_post_hook(split)
