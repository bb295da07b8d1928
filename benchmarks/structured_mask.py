"""The cost of structured outputs per decode step: the same batch of B sequences with and
without a grammar, on one engine. Step times are medians over the steps in which all B rows
decode (constrained rows may finish early; those steps are left out).

The grammars: `json` (a JSON schema), `tool-required` (the forced tool call of
`tool_choice: "required"`, one tool with a long string argument) and `tool-auto` (the
`tool_choice: "auto"` grammar: free text until the model opens a call). The tool grammars
name the format's tags as tokens where the vocabulary has them as special tokens (Qwen's
`<tool_call>`), as the server does.

    python benchmarks/structured_mask.py [--model M] [--grammar json tool-required tool-auto]
        [--format hermes] [--batch 1 16 64] [--steps 48] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from pagecli import LLM, SamplingParams
from pagecli.server.tool_calls import Tags, auto_grammar, call_grammar, get_format

SCHEMA = {
    "type": "object",
    "properties": {
        "story": {"type": "string", "minLength": 300, "maxLength": 2000},
        "mood": {"enum": ["happy", "sad"]},
    },
    "required": ["story", "mood"],
    "additionalProperties": False,
}


STORY_TOOL = {
    "type": "function",
    "function": {
        "name": "write_story",
        "parameters": SCHEMA,  # the JSON-schema case's object, as a tool's arguments
    },
}


def constraint(llm: LLM, kind: str, fmt_name: str) -> dict:
    """The structured-output constraint of one grammar kind."""
    if kind == "json":
        return {"json_schema": SCHEMA}
    fmt = get_format(fmt_name)
    tags = Tags(llm.engine.special_token_ids(list(fmt.tags)))
    make = call_grammar if kind == "tool-required" else auto_grammar
    return {"grammar": make(fmt, [STORY_TOOL], tags=tags)}


def step_times(llm: LLM, batch: int, steps: int, structured: dict | None) -> list[float]:
    engine = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=steps + 8, ignore_eos=True, structured=structured
    )
    for i in range(batch):
        chat = [{"role": "user", "content": f"Write a long story about a cat, number {i}."}]
        ids, text = llm.encode_prompt(chat)
        engine.add_request(f"b{batch}-{i}-{bool(structured)}", ids, params, text)
    times = []
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        prefill = any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if running == batch and not prefill and not engine.scheduler.waiting:
            times.append(elapsed)
    return times[2:]  # the first decode steps warm the kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument(
        "--grammar", nargs="+", default=["json"], choices=["json", "tool-required", "tool-auto"]
    )
    ap.add_argument("--format", default="hermes", help="the tool-call format")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, num_kv_blocks=4096, max_num_seqs=128)
    rows = []
    for kind in args.grammar:
        spec = constraint(llm, kind, args.format)
        for batch in args.batch:
            free_all, con_all = [], []
            for _ in range(args.rounds):  # interleaved, so drift hits both alike
                free_all += step_times(llm, batch, args.steps, None)
                con_all += step_times(llm, batch, args.steps, spec)
            free, con = statistics.median(free_all), statistics.median(con_all)
            rows.append(
                {
                    "grammar": kind,
                    "batch": batch,
                    "free_ms": round(free * 1e3, 2),
                    "constrained_ms": round(con * 1e3, 2),
                    "overhead_pct": round((con / free - 1) * 100, 1),
                    "steps": [len(free_all), len(con_all)],
                }
            )
            print(
                f"{kind:13s} B={batch:3d}  unconstrained {free * 1e3:7.2f} ms  constrained "
                f"{con * 1e3:7.2f} ms  overhead {(con / free - 1) * 100:+5.1f}%  (median of "
                f"{len(free_all)}/{len(con_all)} steps)"
            )
    if args.json:
        print(
            json.dumps(
                {
                    "cpu": platform.processor(),
                    "model": args.model or "default",
                    "threads": llm.engine.runner.num_threads,
                    "rows": rows,
                }
            )
        )


if __name__ == "__main__":
    main()
