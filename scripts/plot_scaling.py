"""Predicted MFU and step time of LLaMA-7B vs GPU count: Lins-auto against the baselines.

Writes docs/scaling_llama7b.png (A800 nodes of 8, seq 4096, micro-batch 1, 4M-token
global batch as in the Lins paper; the planner's alpha-beta model, this runtime's
overlapped executor). Usage: python scripts/plot_scaling.py [--out PATH] [--bf16-reduce]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lins_dtensor.planner import ClusterSpec, TrainingSpec, choose_plan  # noqa: E402

GPUS = [8, 16, 32, 64, 128, 256, 512, 1024]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "scaling_llama7b.png"))
    ap.add_argument("--bf16-reduce", action="store_true", help="reduce gradients in bf16, as the paper does")
    args = ap.parse_args()
    extra = dict(reduce_bytes=2) if args.bf16_reduce else {}
    series: dict[str, list[tuple[int, float, float]]] = {}
    for gpus in GPUS:
        training = TrainingSpec(seq_len=4096, micro_batch=1, global_batch_tokens=4 << 20, **extra)
        plan, ex = choose_plan("llama_7b", ClusterSpec.preset("a800", gpus, 8), training)
        series.setdefault("Lins-auto", []).append((gpus, ex.cost.mfu, ex.cost.step_s))
        fitting = [b for b in ex.baselines if b.cost is not None and b.cost.fits]
        for b in fitting:
            series.setdefault(b.name.replace(" k=8", ""), []).append((gpus, b.cost.mfu, b.cost.step_s))
        print(f"{gpus:5d} GPUs  Lins-auto {str(plan):<28} MFU {ex.cost.mfu:6.1%}  step {ex.cost.step_s:7.3f} s  |  "
              + ", ".join(f"{b.name} {b.cost.mfu:.1%}" for b in fitting))
    fig, (ax_mfu, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, points in series.items():
        xs = [p[0] for p in points]
        style = dict(linewidth=2.5, color="black") if name == "Lins-auto" else dict(linewidth=1.2)
        ax_mfu.plot(xs, [100 * p[1] for p in points], marker="o", label=name, **style)
        ax_time.plot(xs, [p[2] for p in points], marker="o", label=name, **style)
    for ax in (ax_mfu, ax_time):
        ax.set_xscale("log", base=2)
        ax.set_xticks(GPUS, [str(g) for g in GPUS])
        ax.set_xlabel("GPUs (A800, 8 per node)")
        ax.grid(alpha=0.3)
    ax_mfu.set_ylabel("predicted MFU (%)")
    ax_time.set_ylabel("predicted step time (s), 4M tokens/step")
    ax_time.set_yscale("log")
    ax_mfu.legend(fontsize=8)
    mode = "overlapped executor, bf16 grads" if args.bf16_reduce else "overlapped executor, fp32 grads"
    fig.suptitle(f"LLaMA-7B, seq 4096, micro-batch 1, 4M-token batch: planner predictions ({mode}; plans that do not fit are omitted)")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
