"""Triton tensors <-> plain numpy dicts, driven by the specs in :mod:`triton_disagg.protocol`.

``pb_utils`` (``triton_python_backend_utils``) only exists inside a Python
backend stub, so it is passed in; everything else here is plain numpy and
unit-tested without a server.

Invariant: a dict handed to library code has one entry per *present* input,
with the batch axis removed (these models serve one sequence per request) and
the protocol dtype; a request whose batch is not 1 is refused, never sliced.
"""

from __future__ import annotations

import json
from typing import Any, Iterable
# Any here: Triton's pb_utils module and its objects, which have no types.

import numpy as np

from triton_disagg.errors import ErrorCode, RequestError, triton_status
from triton_disagg.protocol import TensorSpec


def strip_batch(name: str, array: np.ndarray) -> np.ndarray:
    if array.ndim == 0 or array.shape[0] != 1:
        raise RequestError(f"input '{name}' has batch size {array.shape[0] if array.ndim else 0}; "
                           f"send one prompt per request (batch size 1)")
    return array[0]


def read_inputs(pb_utils: Any, request: Any, specs: Iterable[TensorSpec]) -> dict[str, np.ndarray]:
    """Every present input of ``request`` named in ``specs``, batch axis removed."""
    out = {}
    for spec in specs:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            out[spec.name] = strip_batch(spec.name, tensor.as_numpy())
    return out


def to_batched(specs: Iterable[TensorSpec], values: dict[str, Any]) -> dict[str, np.ndarray]:
    """Arrays with a leading batch axis of 1, in each spec's dtype, for every name in ``values``."""
    by = {s.name: s for s in specs}
    out = {}
    for name, value in values.items():
        spec = by[name]
        if spec.dtype == "BYTES":
            arr = np.array([v.encode("utf-8") if isinstance(v, str) else v
                            for v in np.ravel(np.asarray(value, dtype=object))], dtype=np.object_)
            arr = arr.reshape(np.shape(value))
        else:
            arr = np.asarray(value, dtype=spec.numpy_dtype)
        out[name] = arr[np.newaxis, ...]
    return out


def make_tensors(pb_utils: Any, specs: Iterable[TensorSpec], values: dict[str, Any]) -> list:
    return [pb_utils.Tensor(name, arr) for name, arr in to_batched(specs, values).items()]


def scalar(inputs: dict[str, np.ndarray], name: str, default: Any = None) -> Any:
    """The single value of a ``[1]`` input, or ``default`` when absent."""
    if name not in inputs:
        return default
    arr = np.ravel(inputs[name])
    if arr.size != 1:
        raise RequestError(f"input '{name}' must hold one value, got {arr.size}")
    value = arr[0]
    return value.item() if hasattr(value, "item") else value


def asks(request: Any, parameter: str) -> bool:
    """Whether ``request`` (a ``pb_utils.InferenceRequest``) sets the request parameter
    ``parameter`` to true (Triton's per-request ``parameters``, which its stub gives as
    JSON)."""
    try:
        return json.loads(request.parameters() or "{}").get(parameter) is True
    except (AttributeError, TypeError, ValueError):
        return False


def error_response(pb_utils: Any, message: str, status: ErrorCode = ErrorCode.INTERNAL) -> Any:
    """A response carrying ``message`` with Triton status ``status`` (an error's
    :class:`~triton_disagg.errors.ErrorCode`, as :func:`~triton_disagg.errors.triton_status`
    writes it): INVALID_ARG reaches the client as HTTP 400 / gRPC INVALID_ARGUMENT,
    UNAVAILABLE and TIMEOUT as 503 / UNAVAILABLE, INTERNAL as 500."""
    name, text = triton_status(ErrorCode(status), message)
    error = pb_utils.TritonError(text, getattr(pb_utils.TritonError, name))
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
