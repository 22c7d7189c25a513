"""Lins' accelerator path on one machine, every side-stream path, against the CPU path.

Run by ``scripts/gpu_smoke.sh`` under torchrun, four ranks (two "nodes" of two). Each
rank trains every case of :data:`CASES` twice, on the device under test and on the CPU
path, and rank 0 writes a JSON and a Markdown report.

``--device cuda``: every rank on the machine's GPU(s) (rank r on cuda:r % count). The
ranks talk through gloo with CUDA tensors: NCCL refuses two ranks on one GPU ("Duplicate
GPU detected"), and torch's threaded test process group runs every collective
synchronously on the host. What gloo costs the check: its ``work.wait()`` on CUDA
tensors blocks the host until its worker thread is done (with NCCL it is a stream
wait), so within a chain the host does not run ahead of the side stream; and its worker
makes the *default* stream wait for each collective's copy-back, which would order the
compute stream after every collective whatever Lins does, so training runs on a stream
of its own here. The host syncs counted are CUDA syncs on the training thread
(``torch.cuda.set_sync_debug_mode``). ``torch.cuda._sleep`` runs before every Lins
collective on the side stream and in every block's forward, so kernels finish late.

``--device fake`` (``gpu_smoke.sh --dry-run``): the same driver on CPU tensors with
``tests/fake_device.py`` standing in for streams and events (host syncs counted by the
fake, device memory not measured); the device branch must give the CPU path's bits.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time
import warnings
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

WORLD, RANKS_PER_NODE, STEPS, MICROBATCHES = 4, 2, 3, 2
SLEEP_CYCLES = 2_000_000  # about 1 ms on a 2 GHz SM clock

# Every side-stream path: FSDP2's reduced shard handed to a Lins G chain (g > p), the
# optim_replica all-reduce, the P-replicated bucket, hpZ, bf16 P, TP 2 inside the node.
CASES = [
    dict(name="fsdp2-into-g-chain", plan="p=2,g=4,os=4"),
    dict(name="optim-replica", plan="p=1,g=2,os=2"),
    dict(name="replicated-bucket", plan="p=1,g=2,os=4"),
    dict(name="hpz", plan="hpz:2"),
    dict(name="bf16", plan="p=2,g=4,os=4", bf16=True),
    dict(name="tp2", plan="p=1,g=2,os=2", tp=2, model={"n_heads": 4}),  # 2 heads per TP rank
]


class HostSyncs:
    """Counts the host's syncs with the device while active: the fake's own count, or
    CUDA's sync debug mode ("warn", so that gloo's worker threads are left alone), each
    warning noted with the line of Python that caused it."""

    def __init__(self, fake) -> None:
        self.fake, self.count, self.where = fake, 0, []

    @contextlib.contextmanager
    def counting(self):
        if self.fake is not None:
            before = self.fake.host_syncs
            yield
            self.count += self.fake.host_syncs - before
            return
        with warnings.catch_warnings():
            warnings.simplefilter("always")

            def note(message, category, filename, lineno, file=None, line=None):
                if "synchronizing" in str(message):
                    self.count += 1
                    if len(self.where) < 5:
                        self.where.append(f"{os.path.relpath(filename)}:{lineno}")

            warnings.showwarning = note
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def device_sleeps(device: torch.device, model: torch.nn.Module):
    """``torch.cuda._sleep`` before each Lins collective (on the side stream) and in each
    block's forward (on the compute stream)."""
    if device.type != "cuda":
        yield
        return
    from lins_dtensor import units
    from tiny_llama import Block

    def slowed(start):
        def call(recorder, stream, spec, *args, **kwargs):
            with stream.scope():
                torch.cuda._sleep(SLEEP_CYCLES)
            return start(recorder, stream, spec, *args, **kwargs)
        return call

    hooks = [m.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(SLEEP_CYCLES)) for m in model.modules() if isinstance(m, Block)]
    names = ("start_all_gather", "start_reduce_scatter", "start_all_reduce")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(units, name, slowed(getattr(units, name))))
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


def train_case(case: dict, device: torch.device, fake_device_cls=None) -> dict:
    """Train one case on ``device`` (with the fake device's streams when given)."""
    if device.type == "cuda":
        # Not the default stream, which gloo's worker threads make wait (module docstring).
        with torch.cuda.stream(torch.cuda.Stream(device)):
            return _train_case(case, device, fake_device_cls)
    return _train_case(case, device, fake_device_cls)


def _train_case(case: dict, device: torch.device, fake_device_cls) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, clip_grad_norm_, lins_optimizer, lins_stats
    from lins_dtensor.runtime import lins_state
    from lins_dtensor.schedule import state_memory_bytes
    from tiny_llama import batch, build_model, loss_fn, tensor_parallelize

    rank = dist.get_rank()
    tp = case.get("tp", 1)
    plan = LinsPlan.parse(case["plan"], WORLD // tp)
    param_dtype = torch.bfloat16 if case.get("bf16") else None
    fake = fake_device_cls() if fake_device_cls is not None else None
    if device.type == "cuda":
        gc.collect()  # the previous case's model and buffers
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(**case.get("model", {})).to(device)
    mesh = build_lins_mesh(plan, ranks_per_node=RANKS_PER_NODE, device_type=device.type, tp=tp,
                           timeout=datetime.timedelta(seconds=60))
    if tp > 1:
        tensor_parallelize(model, mesh.tp_mesh())
    with fake.installed() if fake is not None else contextlib.nullcontext():
        apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    opt = lins_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True)
    syncs = HostSyncs(fake) if device.type == "cuda" or fake is not None else None
    losses = []
    # Lins learns M from step 1, which reduces at optimizer.step(); later steps reduce
    # during their last backward and gather updates into the next forward.
    with device_sleeps(device, model):
        for step in range(STEPS):
            steady = syncs.counting() if syncs is not None and step > 0 else contextlib.nullcontext()
            with steady:
                total = torch.zeros((), device=device)
                for mb in range(MICROBATCHES):
                    loss = loss_fn(model, batch(step, rank // tp, mb).to(device)) / MICROBATCHES
                    loss.backward()
                    total += loss.detach().float()
                clip_grad_norm_(model, 0.5)
                opt.step()
                opt.zero_grad()
            losses.append(total)
    losses = [float(t) for t in losses]
    state = lins_state(model)
    pb = (param_dtype or torch.float32).itemsize
    predicted = sum(state_memory_bytes(state.schedule(), param_bytes=pb, reduce_bytes=4).values())
    stats = lins_stats(model)  # reads the device timings: may sync, outside the checked steps
    masters = {k: v.full_tensor().float().cpu() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
    out = {
        "masters": masters,
        "losses": losses,
        "comm_time": stats.comm_time(),
        "host_syncs": None if syncs is None else syncs.count,
        "sync_sites": [] if syncs is None else syncs.where,
        "states_predicted_bytes": predicted,
        "states_measured_bytes": sum(stats.memory_bytes.values()),
        "inflight_bound_bytes": state.executor.max_inflight_bytes,
    }
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        # Blocks freed with pending uses on other streams (record_stream) count here only.
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        out["allocated_after_bytes"] = torch.cuda.memory_allocated(device)
    return out


def compare(case: dict, tested: dict, cpu: dict, exact: bool) -> dict:
    worst = max(((tested["masters"][k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in cpu["masters"].items())
    loss_diff = max(abs(a - b) for a, b in zip(tested["losses"], cpu["losses"]))
    # GPU against CPU: kernels sum in other orders, and AdamW divides by sqrt(v) + eps,
    # which amplifies that where gradients are tiny; a missing wait moves far more.
    tolerance = 0.0 if exact else (3e-2 if case.get("bf16") else 1e-3)
    ok = worst <= tolerance and loss_diff <= max(tolerance, 1e-6 if not exact else 0.0)
    ok &= tested["host_syncs"] in (None, 0)
    return {"masters_max_rel_err": worst, "loss_max_abs_diff": loss_diff, "tolerance": tolerance, "ok": bool(ok)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cuda", "fake"), required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--label", default="main", help="report file name stem (main, sanitizer)")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    if dist.get_world_size() != WORLD:
        raise SystemExit(f"gpu_smoke: run with {WORLD} ranks, not {dist.get_world_size()}")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        fake_cls = None
    else:
        from fake_device import FakeDevice

        device, fake_cls = torch.device("cpu"), FakeDevice
    report = {"device": args.device, "torch": torch.__version__, "world": WORLD, "ranks_per_node": RANKS_PER_NODE,
              "steps": STEPS, "microbatches": MICROBATCHES, "cases": []}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
        report["sanitizer"] = os.environ.get("TORCH_CUDA_SANITIZER") == "1"
    for case in CASES:
        start = time.perf_counter()
        entry = {"case": case["name"], "plan": case["plan"], "bf16": bool(case.get("bf16")), "tp": case.get("tp", 1)}
        try:
            tested = train_case(case, device, fake_cls)
            cpu = train_case(case, torch.device("cpu"))
            entry.update(compare(case, tested, cpu, exact=args.device == "fake"))
            entry.update({k: v for k, v in tested.items() if k != "masters"})
        except Exception as error:  # noqa: BLE001 - the report names it; the other ranks fail too
            entry.update(ok=False, error=f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
        entry["seconds"] = round(time.perf_counter() - start, 2)
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, {"ok": entry["ok"], "host_syncs": entry.get("host_syncs"), "error": entry.get("error")})
        entry["ok"] = all(g["ok"] for g in gathered)
        entry["per_rank"] = gathered
        report["cases"].append(entry)
        if rank == 0:
            print(f"gpu_smoke: {case['name']} ({case['plan']}{', bf16' if case.get('bf16') else ''}"
                  f"{', tp 2' if case.get('tp') else ''}): {'OK' if entry['ok'] else 'FAILED'} "
                  f"{entry.get('error') or ''}".rstrip(), flush=True)
        if entry.get("error"):
            break  # the process group may be broken: report what ran
    report["ok"] = all(c["ok"] for c in report["cases"]) and len(report["cases"]) == len(CASES)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f"gpu_smoke_{args.label}.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(args.out_dir, f"gpu_smoke_{args.label}.md"), "w") as f:
            f.write(markdown(report))
    dist.destroy_process_group()
    return 0 if report["ok"] else 1


def markdown(report: dict) -> str:
    lines = [f"# gpu_smoke ({report['device']}, torch {report['torch']}{', ' + report['gpu'] if 'gpu' in report else ''}"
             f"{', CUDA sanitizer' if report.get('sanitizer') else ''})", "",
             f"{report['world']} ranks ({report['ranks_per_node']} per node), {report['steps']} steps x M={report['microbatches']}, "
             "against the same ranks on the CPU path.", "",
             "| case | plan | result | masters max rel err | host syncs in steps 2-3 | states measured / predicted (B) | peak allocated / reserved (B) |",
             "|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        lines.append(
            f"| {c['case']} | {c['plan']}{' bf16' if c['bf16'] else ''}{' tp2' if c['tp'] > 1 else ''} | "
            f"{'OK' if c['ok'] else 'FAILED ' + (c.get('error') or '')} | {c.get('masters_max_rel_err', '-')} | "
            f"{c.get('host_syncs', '-')}{' at ' + ', '.join(c['sync_sites']) if c.get('sync_sites') else ''} | "
            f"{c.get('states_measured_bytes', '-')} / {c.get('states_predicted_bytes', '-')} | "
            f"{c.get('peak_allocated_bytes', '-')} / {c.get('peak_reserved_bytes', '-')} |")
    lines += ["", f"Overall: {'OK' if report['ok'] else 'FAILED'}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
