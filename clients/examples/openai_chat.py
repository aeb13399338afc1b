"""Chat with the HTTP front through the official ``openai`` SDK: one streamed chat
completion (the checkpoint's chat template turns the messages into the prompt), then the
same request whole, with its token usage.

    python clients/examples/openai_chat.py "Hello!" --url http://127.0.0.1:8080

Needs ``pip install openai``. ``temperature`` 0 (greedy), so both answers are the same text.
"""

import argparse

from openai import OpenAI


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("message")
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    client = OpenAI(base_url=f"{args.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": args.message}]

    print("streamed: ", end="", flush=True)
    for chunk in client.chat.completions.create(model=model, messages=messages,
                                                max_tokens=args.max_tokens, temperature=0,
                                                stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    reply = client.chat.completions.create(model=model, messages=messages,
                                           max_tokens=args.max_tokens, temperature=0)
    print("whole:    ", reply.choices[0].message.content)
    print(f"usage:     {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} "
          f"completion tokens ({reply.choices[0].finish_reason})")


if __name__ == "__main__":
    main()
