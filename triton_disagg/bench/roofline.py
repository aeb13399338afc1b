"""The batch-1 decode roofline: how fast a token can be if reading the weights is all it costs.

At batch 1 every decode step reads every weight matrix once, so the best possible
rate is ``matvec_bandwidth / weight_bytes_per_token``. The bandwidth is measured
here, on this machine, with the same operation the engine uses (a float32
matrix-vector product over a matrix far larger than the caches).
"""

from __future__ import annotations

import time

import numpy as np

from triton_disagg.engine.spec import ModelShape


def measure_matvec_bandwidth(matrix_bytes: int = 512 << 20, repeats: int = 15) -> float:
    """Bytes per second that ``W @ x`` reads from memory, best of ``repeats`` runs."""
    cols = 4096
    rows = max(1, matrix_bytes // (4 * cols))
    weights = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    vector = np.ones(cols, dtype=np.float32)
    weights @ vector  # warm up: page in the matrix and start the BLAS threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        weights @ vector
        best = min(best, time.perf_counter() - start)
    return weights.nbytes / best


def decode_weight_bytes(shape: ModelShape, bytes_per_weight: int = 4) -> int:
    """Weight bytes one batch-1 decode step reads (float32 compute).

    The embedding lookup reads one row, so only the lm_head's full matrix counts
    (which is the embedding itself for tied models). Norm vectors and biases count.
    """
    h, i = shape.hidden_size, shape.intermediate_size
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    gated_mlp = shape.activation == "silu"
    per_layer = h * (q + 2 * kv) + q * h  # qkv + o
    per_layer += (3 if gated_mlp else 2) * h * i  # gate_up + down | fc + proj
    per_layer += 2 * h  # two norms
    if shape.qkv_bias:
        per_layer += q + 2 * kv
    if shape.family == "gpt2":
        per_layer += 2 * h + h + i + h  # norm biases, o, fc, proj biases
    total = shape.num_layers * per_layer + shape.vocab_size * h + h
    return total * bytes_per_weight


def roofline_tokens_per_second(shape: ModelShape, bandwidth: float) -> float:
    return bandwidth / decode_weight_bytes(shape)
