"""What training loops written for FSDP2 or DDP do on a Lins model."""

from __future__ import annotations

import math

import torch

from distributed import run
from step_scenarios import torch_clip_on_lins_model


def test_torchs_clip_grad_norm_on_the_model_fails_loudly_instead_of_clipping_nothing():
    """Lins keeps gradients in its G buffers, so p.grad was None after backward and
    torch.nn.utils.clip_grad_norm_(model.parameters()) returned 0.0 and clipped nothing.
    Now every parameter that had a gradient carries one that refuses to be read, with
    one line naming lins_dtensor.clip_grad_norm_; the next forward clears them, so
    micro-batches accumulate as before and training is unchanged."""
    configs = [dict(plan="p=1,g=2,os=4"), dict(plan="p=2,g=4,os=4"), dict(plan="p=2,g=4,os=4", param_dtype=torch.bfloat16),
               dict(plan="p=1,g=2,os=2", tp=2)]
    for result in run(torch_clip_on_lins_model, 4, configs):
        cfg = result["config"]
        assert result["with_grad"] == [result["trainable"]] * 2, cfg
        for message in result["raised"]:
            assert message is not None and message.startswith("lins: ") and "lins_dtensor.clip_grad_norm_(model" in message, (cfg, message)
            assert "\n" not in message, cfg
        assert all(math.isfinite(n) and n > 0 for n in result["norms"]), cfg
