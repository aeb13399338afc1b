"""Glue to Triton: tensors, placement, metrics, render, tritonserver, stub watch, server log."""
