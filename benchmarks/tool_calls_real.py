"""Tool calls on a real chat model through `pagecli serve` and the `openai` client: forced
(required, named, streamed), auto, and a two-step agent loop (call, result, answer).

    pagecli serve --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --port 8011 &
    python benchmarks/tool_calls_real.py --base-url http://127.0.0.1:8011/v1
"""

from __future__ import annotations

import argparse
import time

from openai import OpenAI

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What's the weather in Rome today?"}]
SYSTEM = (
    "You are a helpful assistant. When a tool has answered, tell the user the answer in one "
    "sentence."
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    for label, choice in (("required", "required"), ("named", named), ("auto", "auto")):
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], tool_choice=choice, temperature=0,
            max_tokens=60,
        )  # fmt: skip
        c = reply.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        print(
            f"{label:15s} -> finish={c.finish_reason} tool_calls={calls} "
            f"content={c.message.content!r} usage={reply.usage.completion_tokens} "
            f"({time.perf_counter() - start:.1f} s)"
        )
    deltas, finish = [], None
    for chunk in client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=60, stream=True,
    ):  # fmt: skip
        if chunk.choices:
            d = chunk.choices[0].delta
            deltas += [(t.index, t.id, t.function.name, t.function.arguments)
                       for t in d.tool_calls or []]  # fmt: skip
            deltas += [("content", d.content)] if d.content else []
            finish = chunk.choices[0].finish_reason or finish
    print(f"required,stream -> finish={finish} deltas={deltas}")

    messages = [{"role": "system", "content": SYSTEM}, *ASK]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=60,
    )  # fmt: skip
    message = first.choices[0].message
    print("step 1:", first.choices[0].finish_reason,
          [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls])  # fmt: skip
    messages.append(message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Rome: 21 °C, sunny"}
    )
    second = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=80
    )
    print("step 2:", second.choices[0].finish_reason, repr(second.choices[0].message.content))


if __name__ == "__main__":
    main()
