"""Benchmarks: engine throughput against transformers and the memory roofline; serving load."""
