"""Benchmarks (model speed/memory, data_prep throughput); not part of the installed package."""
