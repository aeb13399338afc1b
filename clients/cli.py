"""``triton-disagg client "prompt"``: one request to the served ensemble, text as it arrives.

gRPC streaming by default (``--url`` host:port, default 127.0.0.1:8001);
``--protocol http`` uses ``generate_stream`` (or ``generate`` with
``--no-stream``; default http://127.0.0.1:8000). Sampling options map one to
one onto the ensemble's optional inputs and are sent only when given. The
text goes to stdout as it arrives; TTFT, time per output token and the token
counts go to stderr at the end (``--json`` prints them as one object instead).
"""

from __future__ import annotations

import argparse
import json
import sys

from triton_disagg.errors import UserError

DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "http://127.0.0.1:8000"}
# flag -> (ensemble input, type, help)
SAMPLING = {
    "--temperature": ("temperature", float, "0 = greedy (the server's default)"),
    "--top-k": ("top_k", int, "0 = off"),
    "--top-p": ("top_p", float, "1 = off"),
    "--seed": ("seed", int, "sampling seed"),
    "--min-tokens": ("min_tokens", int, "generate at least N tokens before the end id stops"),
    "--repetition-penalty": ("repetition_penalty", float, "1 = off"),
    "--presence-penalty": ("presence_penalty", float, "0 = off"),
    "--frequency-penalty": ("frequency_penalty", float, "0 = off"),
    "--end-id": ("end_id", int, "end-of-sequence token id (-1: none; default the tokenizer's)"),
    "--pad-id": ("pad_id", int, "padding token id"),
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "client", help="send a prompt to a running server and stream the reply",
        description="Send one prompt to the `ensemble` of a running triton-disagg server "
                    "(gRPC streaming by default, or HTTP generate / generate_stream) and print "
                    "the text as it arrives, then TTFT, time per output token and token counts.")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--url", help="grpc: host:port (default 127.0.0.1:8001); "
                                 "http: http://host:port (default http://127.0.0.1:8000)")
    p.add_argument("--model", default="ensemble", help="model name (default ensemble)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="default 64")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="ask for the whole text in one response")
    for flag, (_, kind, text) in SAMPLING.items():
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--stop-words", nargs="+", default=None, metavar="W",
                   help="stop after any of these words, matched as token sequences as in "
                        "TensorRT-LLM: each word is tokenized alone, so to stop at ' happy' "
                        "mid-sentence pass ' happy' with its leading space (at most 64 words)")
    p.add_argument("--bad-words", nargs="+", default=None, metavar="W",
                   help="never generate these words (tokenized alone, like --stop-words: "
                        "a mid-sentence word needs its leading space)")
    p.add_argument("--include-input", action="store_true",
                   help="non-streaming: return the prompt before the generated text")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token counts, timings) instead")
    p.set_defaults(func=run)


def request_from(args: argparse.Namespace):
    from .stream import GenerateRequest

    if args.max_tokens < 1:
        raise UserError("--max-tokens must be >= 1")
    options = {name: getattr(args, flag[2:].replace("-", "_"))
               for flag, (name, _, _) in SAMPLING.items()}
    options.update(stop_words=args.stop_words, bad_words=args.bad_words)
    if args.include_input:
        options["exclude_input_in_output"] = False
    return GenerateRequest(args.prompt, args.max_tokens, args.stream,
                           {k: v for k, v in options.items() if v is not None})


def send(url: str, protocol: str, model: str, request, on_text=None, timeout: float = 600.0):
    """One request, timed; connection failures and server errors become UserError."""
    import grpc
    from tritonclient.utils import InferenceServerException

    from .stream import GenerateError, grpc_generate, http_generate

    try:
        if protocol == "http":
            return http_generate(url, request, model, on_text, timeout=timeout)
        import asyncio

        import tritonclient.grpc.aio as aio

        async def go():
            async with aio.InferenceServerClient(url) as client:
                return await asyncio.wait_for(grpc_generate(client, request, model, on_text),
                                              timeout)
        return asyncio.run(go())
    except GenerateError as exc:
        raise UserError(f"the server refused the request: {exc}") from None
    except (OSError, TimeoutError, grpc.RpcError, InferenceServerException) as exc:
        raise UserError(f"lost the connection to {url}: {exc}") from None   # requests' are OSErrors


def summary(m, protocol: str, stream: bool) -> dict:
    ms = lambda s: None if s is None else round(s * 1000, 2)  # noqa: E731
    return {"text": "".join(m.text), "num_input_tokens": m.num_input_tokens,
            "num_output_tokens": m.output_tokens, "protocol": protocol, "stream": stream,
            "ttft_ms": ms(m.ttft), "time_per_output_token_ms": ms(m.tpot), "e2e_ms": ms(m.e2e),
            "responses": len(m.arrivals)}


def run(args: argparse.Namespace) -> int:
    from .health import require_ready

    url = args.url or DEFAULT_URLS[args.protocol]
    if args.protocol == "http" and "://" not in url:
        url = f"http://{url}"
    request = request_from(args)
    require_ready(url, args.protocol, args.model)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    m = send(url, args.protocol, args.model, request, None if args.json else show, args.timeout)
    s = summary(m, args.protocol, args.stream)
    if args.json:
        print(json.dumps(s, ensure_ascii=False))
        return 0
    print(flush=True)
    how = "streamed" if args.stream else "in one response"
    lines = [f"--- {s['num_output_tokens']} output tokens ({s['num_input_tokens']} prompt tokens), "
             f"{how} over {args.protocol}, {s['e2e_ms']:.1f} ms end to end"]
    if args.stream:
        tpot = s["time_per_output_token_ms"]
        rate = f" ({1000 / tpot:.0f} tokens/s)" if tpot else ""
        lines.append(f"TTFT {s['ttft_ms']:.1f} ms, time per output token "
                     f"{'n/a' if tpot is None else f'{tpot:.2f} ms'}{rate}")
    else:
        lines.append("TTFT and time per output token need streaming (drop --no-stream)")
    print("\n".join(lines), file=sys.stderr)
    return 0
