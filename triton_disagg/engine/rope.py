"""Rotary position embedding tables, computed the way Hugging Face transformers computes them
(each runner rotates by them: :func:`~triton_disagg.engine.model.apply_rope`, the torch
runner's ``_rope``).

Convention: HF Llama's non-interleaved "rotate_half": channel ``j < hd/2`` pairs with
channel ``j + hd/2``, both rotated by angle ``position * inv_freq[j]``. Tables are
float32 like transformers' (frequencies in float32, then cos/sin).
"""

from __future__ import annotations

import math
from typing import Any
# Any here: values of a checkpoint's JSON rope_scaling.

import numpy as np

from triton_disagg.engine.spec import EngineFormatError

ROPE_TYPES = ("default", "llama3")


def inv_frequencies(head_dim: int, theta: float,
                    rope_scaling: dict[str, Any] | None = None) -> np.ndarray:
    """``[hd/2]`` float32 inverse frequencies, with HF ``rope_scaling`` applied."""
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.float32(theta) ** exponents).astype(np.float32)
    scaling = rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise EngineFormatError(f"rope_scaling type {kind!r} is not supported (supported: "
                                f"{', '.join(ROPE_TYPES)})")
    if kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1 frequency scaling, as transformers' ``_compute_llama3_parameters``."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(inv_freq: np.ndarray, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)``, each ``[num_positions, hd/2]`` float32."""
    angles = np.outer(np.arange(num_positions, dtype=np.float32), inv_freq)  # [P, hd/2]
    return np.cos(angles), np.sin(angles)
