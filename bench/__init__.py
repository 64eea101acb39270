"""Benchmarks: each prints a table and writes JSON (and a PNG) under bench/results/."""
