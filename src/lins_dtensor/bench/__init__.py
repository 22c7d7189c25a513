"""Benchmarks of Lins against FSDP2 / HSDP / hpZ / ZeRO / DDP.

``python -m lins_dtensor.bench.cluster`` (launched by ``scripts/bench_cluster.sh`` on an
emulated multi-node cluster) measures step time, throughput, memory and bytes per link
for each strategy and compares them with the planner's predictions.
"""
