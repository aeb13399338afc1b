"""Load an engine directory's weights for the numpy engine.

Invariant of :func:`load_engine`'s result: the tensor dict holds exactly the names of
:func:`~triton_disagg.engine.spec.weight_names`, each a C-contiguous float32 array of
the shape :func:`expected_shapes` gives; anything else is an :class:`EngineFormatError`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from triton_disagg.engine.spec import (
    FAMILIES, WEIGHTS_FILE, EngineFormatError, EngineSpec, ModelShape, weight_names)


def expected_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in ``weights.safetensors``, keyed by name."""
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    # Keyed by name without its "layers.<i>." prefix.
    shapes = {
        "embed": (v, h), "pos_embed": (shape.max_position_embeddings, h), "lm_head.weight": (v, h),
        "qkv.weight": (q + 2 * kv, h), "qkv.bias": (q + 2 * kv,),
        "o.weight": (h, q), "o.bias": (h,),
        "fc.weight": (i, h), "fc.bias": (i,), "proj.weight": (h, i), "proj.bias": (h,),
        "gate_up.weight": (2 * i, h), "down.weight": (h, i),
    }
    for norm in ("attn_norm", "mlp_norm", "final_norm"):
        shapes[norm + ".weight"] = shapes[norm + ".bias"] = (h,)
    out = {}
    for name in weight_names(shape):
        key = name.split(".", 2)[2] if name.startswith("layers.") else name
        out[name] = shapes[key]
    return out


def load_engine(engine_dir: str | Path) -> tuple[EngineSpec, dict[str, np.ndarray]]:
    """Read ``engine.json`` and every weight (as float32), checking names and shapes."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    spec = EngineSpec.load(engine_dir)
    shape = spec.shape
    if shape.family not in FAMILIES or shape.num_heads % shape.num_kv_heads:
        raise EngineFormatError(
            f"{engine_dir}: unsupported model shape (family {shape.family!r}, "
            f"{shape.num_heads} heads, {shape.num_kv_heads} KV heads); rebuild the engine")
    path = Path(engine_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise EngineFormatError(f"{path}: not found; rebuild with `triton-disagg build --force`")
    try:
        raw = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise EngineFormatError(f"{path}: unreadable ({exc}); rebuild with "
                                f"`triton-disagg build --force`") from exc
    weights = {}
    for name, want in expected_shapes(shape).items():
        if name not in raw:
            raise EngineFormatError(f"{path}: tensor {name!r} is missing; rebuild with "
                                    f"`triton-disagg build --force`")
        if raw[name].shape != want:
            raise EngineFormatError(f"{path}: tensor {name!r} has shape {raw[name].shape}, "
                                    f"expected {want}; rebuild with `triton-disagg build --force`")
        weights[name] = np.ascontiguousarray(raw[name], dtype=np.float32)
    return spec, weights
