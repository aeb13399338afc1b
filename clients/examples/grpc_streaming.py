"""Stream tokens from the ensemble with tritonclient's gRPC client.

    python clients/examples/grpc_streaming.py "The quick brown fox" --url 127.0.0.1:8001

The ensemble is decoupled (one request, many responses), so gRPC goes through
the bidirectional stream even for a single reply; `enable_empty_final_response`
adds a last, empty response flagged `triton_final_response` that marks the end.
"""

import argparse
import queue

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype


def tensor(name, array):
    dtype = "BYTES" if array.dtype == object else np_to_triton_dtype(array.dtype)
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    inputs = [
        tensor("text_input", np.array([[args.prompt.encode()]], dtype=object)),
        tensor("max_tokens", np.array([[args.max_tokens]], dtype=np.int32)),
        tensor("stream", np.array([[True]], dtype=bool)),
        tensor("temperature", np.array([[0.7]], dtype=np.float32)),
        tensor("top_p", np.array([[0.9]], dtype=np.float32)),
        tensor("seed", np.array([[42]], dtype=np.uint64)),
    ]
    responses = queue.Queue()
    with grpcclient.InferenceServerClient(args.url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                raise SystemExit(f"error: {error.message()}")
            text = result.as_numpy("text_output")
            if text is not None:
                print(text[0][0].decode(), end="", flush=True)   # text_output: [batch=1, 1] BYTES
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    print()


if __name__ == "__main__":
    main()
