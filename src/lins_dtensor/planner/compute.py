"""Compute time of a training step from the work each GPU does, kernel by kernel.

Per transformer block the forward runs one GEMM per weight, (M, N, K) = (tokens of the
micro-batch, the weight's rows on this tensor-parallel rank, its columns), causal
attention over each sequence on this rank's heads, and memory-bound elementwise work
(norms, RoPE, SwiGLU, residual adds); the output projection and the loss follow the last
block. Backward runs each GEMM twice (input and weight gradients) and attention's
backward kernel; activation checkpointing re-runs what its policy recomputes
(:data:`lins_dtensor.planner.training.RECOMPUTED_FORWARD`) at those kernels' own rates.
The shapes come from :mod:`lins_dtensor.planner.models`.

The rates are a roofline-style curve of the device (:class:`HardwareSpec`), every FLOP
rate scaled by its fitted ``efficiency``:

* a GEMM takes ``gemm_call_s`` plus the larger of its FLOPs at ``gemm_efficiency`` of
  peak and its operands' bytes at the HBM bandwidth: small GEMMs run below the ceiling;
* attention runs at ``attention_efficiency`` of peak times s / (s + ``attention_half_seq``)
  for sequences of s tokens (short sequences run below it), computing
  ``attention_causal_work`` of the s x s scores (a flash kernel skips the masked half),
  and its backward takes ``attention_backward_ratio`` times the forward's time;
* elementwise work moves its bytes at the HBM bandwidth.

A device whose rate was measured on whole steps (``whole_step_rate``: the ``cpu-emulated``
presets, calibrated by the benchmark's probe) has that work and the GEMMs' memory traffic
inside its rate: with the curve's defaults, every FLOP then runs at ``efficiency`` x peak. MFU counts the model FLOPs by the
usual convention (:func:`model_flops_per_token`); HFU adds the recomputed forward's.
"""

from __future__ import annotations

import dataclasses

from lins_dtensor.planner.hardware import HardwareSpec
from lins_dtensor.planner.models import ModelSpec, block_matmuls
from lins_dtensor.planner.training import TrainingSpec


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul parameter plus causal-free attention
    12 * layers * dim * seq (the PaLM-appendix convention MFU is usually quoted in)."""
    return 6.0 * model.matmul_params + 12.0 * model.n_layers * model.dim * seq_len


@dataclasses.dataclass(frozen=True)
class ComputeTerm:
    """One kind of kernel in one pass, per step on one GPU.

    ``flops`` are what the kernels execute (a causal flash kernel: half the scores);
    ``efficiency`` is the share of peak FLOP/s they ran at by the device's curve (GEMMs
    by their sizes, attention by its sequence length); memory-bound elementwise work has
    no FLOPs and says its ``bytes`` and ``bandwidth`` instead.
    """

    kernel: str  # "gemm", "attention" or "elementwise"
    pass_: str  # "forward", "backward" or "recompute" (activation checkpointing, in backward)
    flops: float
    bytes: float
    seconds: float
    efficiency: float | None  # None: memory-bound
    bandwidth: float | None  # bytes/s of memory-bound work, else None

    def record(self) -> dict:
        """The term as ``lins-plan --json`` prints it."""
        return {
            "kernel": self.kernel, "pass": self.pass_, "seconds": round(self.seconds, 6), "tflops": round(self.flops / 1e12, 3),
            "efficiency": None if self.efficiency is None else round(self.efficiency, 4),
            "gb": round(self.bytes / 1e9, 3), "bandwidth_gb_s": None if self.bandwidth is None else round(self.bandwidth / 1e9, 1),
        }


@dataclasses.dataclass(frozen=True)
class StepCompute:
    """The compute of one step on one GPU: its terms, and the recomputed forward's model
    FLOPs (by the MFU convention) that turn MFU into HFU."""

    terms: tuple[ComputeTerm, ...]
    model_flops: float  # per GPU per step, by model_flops_per_token
    recomputed_model_flops: float

    def seconds(self, *passes: str) -> float:
        return sum(t.seconds for t in self.terms if t.pass_ in passes)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel call's work and its time by the device's curve (in a step: per
    micro-batch, before multiplying by passes and micro-batches)."""

    flops: float
    bytes: float
    seconds: float


def gemm(hw: HardwareSpec, m: int, n: int, k: int, element_bytes: int) -> Kernel:
    """An (M, N, K) GEMM with ``element_bytes`` operands."""
    flops = 2.0 * m * n * k
    nbytes = float(element_bytes * (m * k + k * n + m * n))
    memory_s = 0.0 if hw.whole_step_rate else nbytes / hw.hbm_bw
    seconds = hw.gemm_call_s + max(flops / (hw.efficiency * hw.gemm_efficiency * hw.peak_flops), memory_s)
    return Kernel(flops, nbytes, seconds)


def attention_efficiency(hw: HardwareSpec, seq_len: int) -> float:
    """Share of peak FLOP/s causal attention's forward reaches on sequences of ``seq_len``."""
    return hw.efficiency * hw.attention_efficiency * seq_len / (seq_len + hw.attention_half_seq)


def attention(hw: HardwareSpec, batch: int, heads: int, seq_len: int, head_dim: int) -> Kernel:
    """Causal attention's forward over ``batch`` sequences on ``heads`` heads: QK^T and PV
    over ``attention_causal_work`` of the scores (its backward takes
    ``attention_backward_ratio`` times this time)."""
    flops = hw.attention_causal_work * 4.0 * seq_len * seq_len * head_dim * heads * batch
    return Kernel(flops, 0.0, flops / (attention_efficiency(hw, seq_len) * hw.peak_flops) if flops else 0.0)


def _elementwise_bytes(model: ModelSpec, training: TrainingSpec, tp: int) -> tuple[float, float, float]:
    """Per token and micro-batch on one rank: bytes the forward's elementwise work of one
    block reads and writes, and the loss's forward and backward bytes. Each op reads its
    inputs and writes its output once (a fused kernel): per block, two RMSNorms (d in,
    d out), RoPE on q and k, two residual adds (2 in, 1 out), SiLU (f, f) and the gating
    product (2f, f); a block's backward moves twice its forward's bytes. The loss casts
    the logits to fp32 and takes their log-softmax, and back (its backward also reads the
    saved output). Sequence and tensor parallelism leave each rank 1/tp of all of it."""
    a = training.activation_bytes
    d, kv, f = model.dim, model.kv_heads * model.head_dim, model.ffn_dim
    block = a * (2 * 2 * d + 2 * (d + kv) + 2 * 3 * d + 2 * f + 3 * f) / tp
    loss_forward = model.vocab_size * ((a + 4) + (4 + 4)) / tp
    loss_backward = model.vocab_size * ((4 + 4 + 4) + (4 + a)) / tp
    return block, loss_forward, loss_backward


def step_compute(model: ModelSpec, training: TrainingSpec, hw: HardwareSpec, tp: int, microbatches: int) -> StepCompute:
    """The compute terms of one step of ``microbatches`` micro-batches on one GPU."""
    tokens, seq = training.microbatch_tokens, training.seq_len
    a = training.activation_bytes
    policy = training.recompute
    layers = model.n_layers
    # Forward of one block: each GEMM, and which the policy re-runs.
    gemms = [gemm(hw, tokens, n, k, a) for n, k in block_matmuls(model, tp)]
    recomputed = [g for i, g in enumerate(gemms) if policy.recomputes_matmul(i)]
    head = gemm(hw, tokens, model.vocab_size // tp, model.dim, a)
    attn = attention(hw, training.micro_batch, model.n_heads // tp, seq, model.head_dim)
    attention_flops, attention_s = attn.flops, attn.seconds
    scores = attention_flops / hw.attention_causal_work  # QK^T and PV, every score
    block_bytes, loss_forward, loss_backward = (tokens * b for b in _elementwise_bytes(model, training, tp))
    elementwise_bw = None if hw.whole_step_rate else hw.hbm_bw

    def gemm_terms(kernels: list[Kernel], calls: int, pass_: str) -> ComputeTerm:
        flops = calls * microbatches * sum(g.flops for g in kernels)
        seconds = calls * microbatches * sum(g.seconds for g in kernels)
        nbytes = calls * microbatches * sum(g.bytes for g in kernels)
        return ComputeTerm("gemm", pass_, flops, nbytes, seconds, flops / (seconds * hw.peak_flops) if seconds else None, None)

    def attention_terms(flops: float, seconds: float, pass_: str) -> ComputeTerm:
        flops, seconds = flops * layers * microbatches, seconds * layers * microbatches
        return ComputeTerm("attention", pass_, flops, 0.0, seconds, flops / (seconds * hw.peak_flops) if seconds else None, None)

    def elementwise(nbytes: float, pass_: str) -> ComputeTerm:
        nbytes *= microbatches
        return ComputeTerm("elementwise", pass_, 0.0, nbytes, nbytes / elementwise_bw if elementwise_bw else 0.0, None, elementwise_bw)

    block_gemms = gemms * layers
    terms = [
        gemm_terms([*block_gemms, head], 1, "forward"),
        attention_terms(attention_flops, attention_s, "forward"),
        gemm_terms([*block_gemms, head], 2, "backward"),
        attention_terms(2 * attention_flops, hw.attention_backward_ratio * attention_s, "backward"),
    ]
    if elementwise_bw:
        terms += [elementwise(layers * block_bytes + loss_forward, "forward"), elementwise(2 * layers * block_bytes + loss_backward, "backward")]
    if recomputed:
        terms.append(gemm_terms(recomputed * layers, 1, "recompute"))
    if policy.attention:
        terms.append(attention_terms(attention_flops, attention_s, "recompute"))
    if policy.elementwise and elementwise_bw:
        terms.append(elementwise(layers * block_bytes, "recompute"))
    # The recomputed forward by the MFU convention: its matmuls' 2 FLOPs per weight and
    # token, and attention's 4 * seq * dim per token and layer, scores all counted.
    recomputed_model = sum(g.flops for g in recomputed) * layers + (scores * layers if policy.attention else 0.0)
    model_flops = model_flops_per_token(model, seq) * tokens / tp
    return StepCompute(tuple(t for t in terms if t.seconds or t.flops), model_flops * microbatches, recomputed_model * microbatches)
