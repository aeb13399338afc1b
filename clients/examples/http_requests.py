"""Call the ensemble with plain `requests`: `generate` (whole text) and
`generate_stream` (server-sent events, one text delta per event).

    python clients/examples/http_requests.py "The quick brown fox" --url http://127.0.0.1:8000

The deltas of `generate_stream` concatenate to the text `generate` returns.
"""

import argparse
import json

import requests


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    base = f"{args.url}/v2/models/ensemble"
    body = {"text_input": args.prompt, "max_tokens": args.max_tokens}

    reply = requests.post(f"{base}/generate", json=body, timeout=300)
    reply.raise_for_status()
    print("generate:       ", reply.json()["text_output"])

    print("generate_stream: ", end="", flush=True)
    with requests.post(f"{base}/generate_stream", json={**body, "stream": True},
                       stream=True, timeout=300) as events:
        events.raise_for_status()
        for line in events.iter_lines():
            if line.startswith(b"data:"):
                event = json.loads(line[len(b"data:"):])
                if "error" in event:
                    raise SystemExit(f"error: {event['error']}")
                print(event["text_output"], end="", flush=True)
    print()


if __name__ == "__main__":
    main()
