"""Benchmarks for Ferry: open-loop load generator, raw model throughput, and the one-command report."""
