"""The CUDA path of Lins, checked against the same run on CPU (see scripts/gpu_smoke.sh).

Run by torchrun, once per backend: ``--backend nccl`` trains the tests' tiny LLaMA on
every GPU (one rank each), ``--backend gloo`` the same ranks on CPU. Each run trains
every plan of ``--plans`` for a few steps with M = 2 micro-batches (the last one reducing
during its backward, the update gathers overlapping the next forward) and writes the
final masters and losses to ``--out``; ``--compare`` then checks the GPU run against
the CPU one and prints what it checked. TF32 is off, so the two differ only by kernel
summation order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

STEPS, MICROBATCHES = 3, 2


def plans_for(world: int) -> list[str]:
    """fsdp preset (P sharded by FSDP2), P replicated (no FSDP2), and a mixed plan."""
    if world == 1:
        return ["ddp"]  # the only plan of one rank: P replicated, every level local
    out = ["fsdp", f"p=1,g={world},os={world}"]
    if world >= 4:
        out.append(f"p=2,g={world // 2},os={world}")
    return out


def train(backend: str, out_path: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, clip_grad_norm_, lins_optimizer, lins_stats, set_gradient_accumulation_steps
    from tiny_llama import batch, build_model, loss_fn

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {}
    for text in plans_for(world):
        plan = LinsPlan.parse(text, world)
        model = build_model().to(device)
        mesh = build_lins_mesh(plan, ranks_per_node=world, device_type=device.type)
        apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        set_gradient_accumulation_steps(model, MICROBATCHES)
        opt = lins_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True)
        losses = []
        for step in range(STEPS):
            total = 0.0
            for mb in range(MICROBATCHES):
                loss = loss_fn(model, batch(step, rank, mb).to(device)) / MICROBATCHES
                loss.backward()
                total += loss.item()
            clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
            losses.append(total)
        stats = lins_stats(model)
        masters = {k: v.full_tensor().float().cpu() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
        if rank == 0:
            results[str(plan)] = {"masters": masters, "losses": losses, "comm_time": stats.comm_time()}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def compare(gpu_path: str, cpu_path: str) -> int:
    gpu, cpu = torch.load(gpu_path, weights_only=False), torch.load(cpu_path, weights_only=False)
    failed = False
    for plan, g in gpu.items():
        c = cpu[plan]
        worst = max(((g["masters"][k] - c["masters"][k]).norm() / c["masters"][k].norm().clamp_min(1e-12)).item() for k in c["masters"])
        loss_diff = max(abs(a - b) for a, b in zip(g["losses"], c["losses"]))
        ok = worst < 1e-4 and loss_diff < 1e-4
        failed |= not ok
        print(f"gpu_smoke: plan {plan}: {STEPS} steps x M={MICROBATCHES}, masters vs CPU max relative error {worst:.2e}, "
              f"losses max |diff| {loss_diff:.2e} -> {'OK' if ok else 'MISMATCH'}; Lins collective time per state on GPU "
              f"{json.dumps({s: {k: round(v, 4) for k, v in e.items()} for s, e in g['comm_time'].items()})}")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("nccl", "gloo"))
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2, metavar=("GPU", "CPU"))
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    train(args.backend, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
