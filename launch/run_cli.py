"""`triton-disagg run`: generate from an engine directory in-process (no server).

Greedy by default; stops at the engine's eos id unless ``--end-id -1``. ``--text`` is
tokenized as the server tokenizes a completion's prompt (with the special tokens, such as a
BOS, the tokenizer's configuration adds; ``--no-special-tokens``: without). Stop and bad
words are text, tokenized with the engine's tokenizer (without special tokens). With
``--json`` it prints one object ``{"input_ids", "output_ids" (generated only), "text"}``.
"""

from __future__ import annotations

import argparse
import json

from triton_disagg.engine.runtime import DEVICES, RUNTIMES
from triton_disagg.errors import UserError


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--input-ids: expected comma-separated token ids like 1,2,3, "
                        f"got {text!r}") from None


def _run(args: argparse.Namespace) -> int:
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.runtime import Runtime
    from triton_disagg.engine.sampling import SamplingParams
    from triton_disagg.engine.spec import EngineSpec
    from triton_disagg.front.tokenizer import Tokenizer

    spec = EngineSpec.load(args.engine)             # fail fast, before loading weights
    tokenizer = Tokenizer(args.engine)
    prompt = (tokenizer.encode(args.text, not args.no_special_tokens) if args.text is not None
              else _token_ids(args.input_ids))
    end_id = spec.eos_token_id if args.end_id is None else args.end_id
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens, end_id=None if end_id is None or end_id < 0 else end_id,
        stop_words=[tokenizer.encode_word(w) for w in args.stop_words],
        bad_words=[tokenizer.encode_word(w) for w in args.bad_words])
    runtime = Runtime.default(args.runtime, args.device)
    engine = LLMEngine(args.engine, num_blocks=-(-spec.max_seq_len // spec.kv.tokens_per_block),
                       runtime=runtime)
    (seq,) = engine.generate([prompt], params)
    text = tokenizer.decode(seq.output_ids)
    if args.json:
        print(json.dumps({"input_ids": seq.prompt_ids, "output_ids": seq.output_ids,
                          "text": text}, ensure_ascii=False))
    else:
        print(text)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run", help="generate text from an engine directory, in this process",
        description="Generate from an engine directory in this process (no server). "
                    "Greedy by default; stops at the engine's eos token.")
    run.add_argument("--engine", required=True, metavar="DIR", help="engine directory")
    prompt = run.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--text", help="prompt text (tokenized with the engine's tokenizer)")
    prompt.add_argument("--input-ids", metavar="IDS", help="prompt token ids, e.g. 1,2,3")
    run.add_argument("--no-special-tokens", action="store_true",
                     help="tokenize --text without the special tokens (e.g. BOS) the "
                          "tokenizer's configuration adds, as a server does a chat's text")
    run.add_argument("--max-tokens", type=int, required=True, metavar="N",
                     help="most tokens to generate")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off (default)")
    run.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1 = off (default)")
    run.add_argument("--seed", type=int, default=None, metavar="N", help="sampling seed")
    run.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X")
    run.add_argument("--presence-penalty", type=float, default=0.0, metavar="X")
    run.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X")
    run.add_argument("--min-tokens", type=int, default=0, metavar="N",
                     help="generate at least N tokens before the end id may stop")
    run.add_argument("--end-id", type=int, default=None, metavar="ID",
                     help="end-of-sequence token id (default: the engine's eos; -1 = none)")
    run.add_argument("--stop-words", nargs="+", default=[], metavar="W",
                     help="stop after generating any of these words (kept in the output)")
    run.add_argument("--bad-words", nargs="+", default=[], metavar="W",
                     help="never generate these words")
    run.add_argument("--runtime", choices=RUNTIMES, default=None,
                     help="model runner (default: torch on a visible GPU, else numpy)")
    run.add_argument("--device", choices=DEVICES, default=None,
                     help="cpu or cuda (default: cuda when a GPU is visible and the runtime "
                          "is torch)")
    run.add_argument("--json", action="store_true",
                     help='print {"input_ids", "output_ids", "text"} as one JSON object')
    run.set_defaults(func=_run)
