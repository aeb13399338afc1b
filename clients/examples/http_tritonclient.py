"""Check health and read the ensemble's interface with tritonclient's HTTP client, then
generate through Triton's HTTP `generate` endpoint.

    python clients/examples/http_tritonclient.py "The quick brown fox" --url 127.0.0.1:8000

KServe `infer` over HTTP refuses decoupled models (the ensemble streams, so it is
decoupled): Triton answers 501. Over HTTP, use `generate` (one JSON reply) or
`generate_stream` (server-sent events); tritonclient.http has no method for
them, so the last step posts with the standard library.
"""

import argparse
import json
import urllib.request

import tritonclient.http as httpclient


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    parser.add_argument("--url", default="127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    client = httpclient.InferenceServerClient(args.url)
    if not (client.is_server_ready() and client.is_model_ready("ensemble")):
        raise SystemExit("server or ensemble not ready yet")
    config = client.get_model_config("ensemble")
    optional = [i["name"] for i in config["input"] if i.get("optional")]
    print(f"ensemble accepts text_input, max_tokens and optionally: {', '.join(optional)}")

    body = {"text_input": args.prompt, "max_tokens": args.max_tokens, "temperature": 0.7,
            "top_k": 40, "seed": 42, "return_num_output_tokens": True}
    request = urllib.request.Request(f"http://{args.url}/v2/models/ensemble/generate",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        out = json.load(reply)
    print(out["text_output"])
    print(f"({out['num_output_tokens']} tokens)")


if __name__ == "__main__":
    main()
