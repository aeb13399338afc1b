"""``decoupled_mode: false``: the ensemble answers plain, non-streaming ``infer()`` over gRPC
and HTTP tritonclient, as a TensorRT-LLM ensemble deployed without decoupled mode does.
Greedy text equals the offline engine's, CJK and emoji included; a streaming request gets
a clear error naming the setting, and the server keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import servers
from servers import PROMPTS

MAX_TOKENS = 16


def _inputs(module, text: str, stream: bool | None = None) -> list:
    values = {"text_input": np.array([[text.encode()]], dtype=object),
              "max_tokens": np.array([[MAX_TOKENS]], dtype=np.int32)}
    if stream is not None:
        values["stream"] = np.array([[stream]], dtype=bool)
    tensors = []
    for name, arr in values.items():   # [batch 1, 1], as with TensorRT-LLM's ensemble
        dtype = "BYTES" if arr.dtype == object else module.np_to_triton_dtype(arr.dtype)
        tensors.append(module.InferInput(name, list(arr.shape), dtype))
        tensors[-1].set_data_from_numpy(arr)
    return tensors


@pytest.fixture(scope="module")
def served(demo_engine, tmp_path_factory):
    with servers.serve_config(f"model: {{engine: {demo_engine}}}\ndecoupled_mode: false\n"
                              f"kv_cache: {{strategy: direct_transfer, max_size: 64MB}}\n",
                              tmp_path_factory.mktemp("nondecoupled")) as served:
        yield served


def test_plain_infer_over_grpc_and_http_equals_offline(served, demo_engine):
    offline = servers.offline_text(demo_engine)
    http_url = served.http.removeprefix("http://")
    with grpcclient.InferenceServerClient(served.grpc) as grpc, \
            httpclient.InferenceServerClient(http_url) as http:
        for module, client in ((grpcclient, grpc), (httpclient, http)):
            for prompt in PROMPTS:
                result = client.infer("ensemble", _inputs(module, prompt))
                text = result.as_numpy("text_output").reshape(-1)[0].decode()   # [1, 1]
                assert text == offline(prompt, MAX_TOKENS), (module.__name__, prompt)
    status, body = servers.generate(served.http, {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS})
    assert status == 200 and body["text_output"] == offline(PROMPTS[0], MAX_TOKENS)


def test_a_streaming_request_gets_a_clear_error(served):
    with grpcclient.InferenceServerClient(served.grpc) as client:
        with pytest.raises(InferenceServerException, match="decoupled_mode: false"):
            client.infer("ensemble", _inputs(grpcclient, PROMPTS[0], stream=True))
        result = client.infer("ensemble", _inputs(grpcclient, PROMPTS[0], stream=False))
        assert result.as_numpy("text_output").reshape(-1)[0]


def test_a_direct_http_call_to_the_orchestrator_is_refused(served):
    """Not decoupled, the orchestrator answers plain HTTP infer(): unsealed, it refuses."""
    arrays = servers.orchestrator_arrays(list(range(3, 20)), 4, sealed=False)
    arrays["stream"] = np.array([[False]])
    tensors = []
    for name, arr in arrays.items():
        tensors.append(httpclient.InferInput(name, list(arr.shape),
                                             httpclient.np_to_triton_dtype(arr.dtype)))
        tensors[-1].set_data_from_numpy(arr)
    with httpclient.InferenceServerClient(served.http.removeprefix("http://")) as client:
        with pytest.raises(InferenceServerException, match="preprocessed.*ensemble") as err:
            client.infer("orchestrator", tensors)
        assert err.value.status() == "400", err.value.status()
        assert client.infer("ensemble", _inputs(httpclient, PROMPTS[0])).as_numpy("text_output")
