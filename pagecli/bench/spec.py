"""`pagecli bench --scenario spec`: speculative decoding on and off, side by side in one
process, on prompts built from real text (pagecli's own source, which ships with it).

Four workloads, each a few chat requests run one at a time (single-stream decode, where
speculation pays): a code edit (rename a variable in a function and show it), a quote (a
function's docstring word for word), a JSON extraction from a function, and open chat.
Greedy, stopped at EOS (or max_tokens). Each request runs with the proposer off, then on,
`repetitions` times each; a row gives the median decode rate of each mode, the speedup, the
drafts' acceptance rate and mean accepted length, and whether both modes gave the same
tokens.
"""

from __future__ import annotations

import inspect
import statistics
import textwrap
import time

from pagecli.llm import LLM
from pagecli.sampling_params import SamplingParams

# (function, variable to rename, its new name)
_EDITS = [
    ("pagecli.engine.block_manager:BlockManager.allocate_slots", "needed", "wanted"),
    ("pagecli.engine.scheduler:Scheduler._preempt", "seq", "victim"),
    ("pagecli.engine.spec_decode.ngram:NgramIndex.lookup", "length", "size"),
]


def _source(spec: str) -> str:
    """A function's source as a user would paste it (`module:Class.function`): the method's
    lines less their common indentation, so the body stays indented under its `def`."""
    import importlib

    module_name, _, path = spec.partition(":")
    target = importlib.import_module(module_name)
    for part in path.split("."):
        target = getattr(target, part)
    return textwrap.dedent(inspect.getsource(target)).strip()


def workloads(num_prompts: int = 2) -> dict[str, list[list[dict]]]:
    """The four workloads' chat requests (at most `num_prompts` each)."""

    def chat(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    edits, quotes, extracts = [], [], []
    for spec, old, new in _EDITS[:num_prompts]:
        code = _source(spec)
        edits.append(
            chat(
                f"Rename the variable `{old}` to `{new}` in this Python function. Answer with "
                f"the whole function and nothing else.\n\n```python\n{code}\n```"
            )
        )
        quotes.append(
            chat(
                "Quote the docstring of this Python function word for word, and nothing "
                f"else.\n\n```python\n{code}\n```"
            )
        )
        extracts.append(
            chat(
                "Extract from this Python function a JSON object with the keys `name`, "
                "`parameters` (a list of names) and `calls` (the functions it calls). "
                f"Answer with the JSON only.\n\n```python\n{code}\n```"
            )
        )
    chats = [
        chat("Write a short story about a lighthouse keeper who collects shells."),
        chat("Explain why the sky is blue to a ten-year-old."),
        chat("Give three tips for learning to play the guitar."),
    ][:num_prompts]
    return {"code_edit": edits, "quote": quotes, "json_extraction": extracts, "chat": chats}


def run_spec(llm: LLM, refresh, max_tokens: int, repetitions: int, num_prompts: int) -> list[dict]:
    """One row per workload; `llm` was loaded with a speculative config (its proposer is
    taken away for the runs without)."""
    engine = llm.engine
    proposer = engine.proposer
    if proposer is None:
        raise ValueError("the spec scenario needs a speculative config")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=4))  # warm
    rows = []
    for name, prompts in workloads(num_prompts).items():
        rates: dict[str, list[float]] = {"off": [], "on": []}
        tokens: dict[str, list[list[int]]] = {"off": [], "on": []}
        counters = engine.scheduler.counters
        before = (counters.spec_drafts, counters.spec_draft_tokens, counters.spec_accepted_tokens)
        for _ in range(repetitions):
            for mode in ("off", "on"):
                engine.proposer = proposer if mode == "on" else None
                generated, seconds, ids = 0, 0.0, []
                for prompt in prompts:
                    start = time.perf_counter()
                    (out,) = llm.generate([prompt], params)
                    first = out.metrics.get("first_token_time", start)
                    seconds += time.perf_counter() - first  # decode time, after the prefill
                    generated += max(len(out.token_ids) - 1, 0)
                    ids.append(out.token_ids)
                    refresh()
                rates[mode].append(generated / seconds if seconds else 0.0)
                tokens[mode] = ids
        engine.proposer = proposer
        drafts = counters.spec_drafts - before[0]
        draft_tokens = counters.spec_draft_tokens - before[1]
        accepted = counters.spec_accepted_tokens - before[2]
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        rows.append(
            {
                "engine": "pagecli",
                "workload": name,
                "num_requests": len(prompts),
                "output_tokens": sum(len(t) for t in tokens["on"]),
                "decode_tokens_per_s_off": off,
                "decode_tokens_per_s_on": on,
                "speedup": on / off if off else 0.0,
                "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
                "identical": tokens["on"] == tokens["off"],
            }
        )
    return rows
