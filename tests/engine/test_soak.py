"""Engine soak: a long random workload on a cache small enough to force preemption and
evictions, in both preemption modes, with the block pool's invariants checked after every
step.

Random prompts (some with a shared prefix), random sampling parameters (n up to 4, stop
strings, seeds, penalties, max_tokens 1..64), random aborts. At the end: every request ended
exactly once, no block is in use, greedy requests gave the ids they give alone, and the
process's RSS after warm-up grew by under 5%.

`PAGECLI_SOAK_REQUESTS` sets the size per mode (CI default below; the issue's full size is
2000: `PAGECLI_SOAK_REQUESTS=2000 pytest -m soak -s` prints the numbers).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field

import pytest

from pagecli.config import EngineConfig
from pagecli.engine.llm_engine import LLMEngine
from pagecli.sampling_params import SamplingParams
from tests.sizes import size

pytestmark = pytest.mark.soak

NUM_REQUESTS = int(os.environ.get("PAGECLI_SOAK_REQUESTS", size(150, 300)))
# RSS is first measured once this many requests were added: a process's memory grows for
# its first ~2,000 steps of this workload (caches of torch and oneDNN, malloc's high-water
# mark; Python objects stay flat), then stays flat (measured over 6,000 steps).
WARM_UP_REQUESTS = max(200, NUM_REQUESTS // 5)
MAX_IN_FLIGHT = 24
ABORT_PROBABILITY = 0.01  # per step: abort one random unfinished request
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 48  # 192 tokens: a few requests at once, so preemption is the rule
NUM_SWAP_BLOCKS = 40
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
STOPS = [["e"], ["an", "or"], ["the"], ["\n"], ["in", "at", "on"]]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module", autouse=True)
def keep_thread_count():
    """The soak's engines run on one thread (a process-wide setting): restore it after."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def soak_model(tiny_models, default_model_dir, tmp_path_factory):
    """The tiny Llama 3 with the default model's tokenizer (its first 384 ids are bytes and
    short merges), so stop strings are matched on real text."""
    folder = tmp_path_factory.mktemp("soak") / "tiny-llama3"
    shutil.copytree(tiny_models["llama3"], folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def alone(soak_model):
    """An engine with room to spare that runs one request at a time: the reference."""
    engine = LLMEngine(
        EngineConfig(
            model=soak_model,
            block_size=BLOCK_SIZE,
            num_kv_blocks=512,
            dtype="float32",  # the soak's dtype
            num_threads=1,
            seed=1,
        )
    )

    def run(prompt: list[int], params: SamplingParams) -> list[list[int]]:
        engine.add_request("alone", prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    result = [c.token_ids for c in output.outputs]
        return result

    return run


def random_request(rng: random.Random, prefixes: list[list[int]], vocab: int):
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
    if rng.random() < 0.5:
        prompt = rng.choice(prefixes) + prompt[: rng.randint(1, 12)]
    greedy = rng.random() < 0.35
    params = SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3, 4]),
        max_tokens=rng.randint(1, 64),
        temperature=0.0 if greedy else rng.choice([0.6, 1.0, 1.3]),
        top_k=rng.choice([0, 0, 5, 50]),
        top_p=rng.choice([1.0, 1.0, 0.9]),
        seed=rng.choice([None, rng.randrange(2**31)]),
        stop=rng.choice(STOPS) if rng.random() < 0.25 else [],
        ignore_eos=rng.random() < 0.5,
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
    )
    return prompt, params


@dataclass
class SoakResult:
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_steps: int = 0
    rss_after_warm_up: int = 0
    rss_at_end: int = 0
    stats: dict = field(default_factory=dict)
    greedy: list = field(default_factory=list)  # (prompt, params, sample ids) of finished ones


def soak(model: str, mode: str, num_requests: int, seed: int) -> SoakResult:
    rng = random.Random(seed)
    config = EngineConfig(
        model=model,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=256,
        preemption_mode=mode,
        dtype="float32",  # BLOCK_BYTES; `auto` is bfloat16 on a CPU with native bfloat16
        num_threads=1,  # ops this small only pay for threads, more so on a loaded machine
        swap_space=NUM_SWAP_BLOCKS * BLOCK_BYTES / 2**30 if mode == "swap" else 0,
        seed=seed,
    )
    engine = LLMEngine(config)
    if mode == "swap":
        assert engine.runner.num_swap_blocks == NUM_SWAP_BLOCKS
    vocab = engine.hf_config.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(12)] for _ in range(3)]
    result = SoakResult(num_requests=num_requests)
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    ended: dict[str, str] = {}  # request id -> "finished" or "aborted"
    unfinished: set[str] = set()
    warm_up_at = max(1, min(WARM_UP_REQUESTS, num_requests // 2))
    added = 0
    while added < num_requests or unfinished:
        while added < num_requests and len(unfinished) < MAX_IN_FLIGHT and rng.random() < 0.6:
            request_id = f"r{added}"
            prompt, params = random_request(rng, prefixes, vocab)
            engine.add_request(request_id, prompt, params)
            requests[request_id] = (prompt, params)
            unfinished.add(request_id)
            added += 1
            if added == warm_up_at:
                result.rss_after_warm_up = rss_bytes()
        if unfinished and rng.random() < ABORT_PROBABILITY:
            victim = rng.choice(sorted(unfinished))
            engine.abort_request(victim)
            unfinished.discard(victim)
            ended[victim] = "aborted"
        if not engine.has_unfinished_requests():
            continue
        outputs = engine.step()
        result.num_steps += 1
        engine.check_invariants()
        for output in outputs:
            rid = output.request_id
            assert ended.get(rid) != "aborted", f"{rid}: output after its abort"
            if not output.finished:
                continue
            assert rid not in ended, f"{rid} finished twice"
            ended[rid] = "finished"
            unfinished.discard(rid)
            prompt, params = requests[rid]
            check_output(output, params)
            if params.greedy:
                result.greedy.append((prompt, params, [c.token_ids for c in output.outputs]))
    result.rss_at_end = rss_bytes()
    stats = engine.stats()
    assert set(ended) == set(requests), "a request never ended"
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    engine.check_invariants()
    assert stats.blocks_in_use == 0 and stats.blocks_swapped == 0
    result.num_finished = sum(v == "finished" for v in ended.values())
    result.num_aborted = sum(v == "aborted" for v in ended.values())
    result.stats = stats.as_dict()
    return result


def check_output(output, params: SamplingParams) -> None:
    assert len(output.outputs) == params.n
    for c in output.outputs:
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        assert 1 <= len(c.token_ids) <= params.max_tokens
        if c.finish_reason == "length":
            assert len(c.token_ids) == params.max_tokens
        assert not any(s in c.text for s in params.stop), (c.text, params.stop)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak(soak_model, alone, mode):
    result = soak(soak_model, mode, NUM_REQUESTS, seed=15 if mode == "recompute" else 16)
    s = result.stats
    growth = result.rss_at_end / result.rss_after_warm_up - 1
    print(
        f"\nsoak {mode}: {result.num_requests} requests ({result.num_finished} finished, "
        f"{result.num_aborted} aborted), {result.num_steps} steps, "
        f"preemptions recompute {s['preemptions_recompute']} swap {s['preemptions_swap']}, "
        f"evictions {s['evictions']}, prefix hits {s['prefix_hit_tokens']} tokens, "
        f"copy-on-write {s['cow_copies']}, greedy checked {len(result.greedy)}, "
        f"RSS {result.rss_after_warm_up / 2**20:.1f} -> {result.rss_at_end / 2**20:.1f} MiB "
        f"({growth:+.2%})"
    )
    assert s["preemptions_recompute"] + s["preemptions_swap"] > 0
    if mode == "swap":
        assert s["preemptions_swap"] > 0
    assert s["evictions"] > 0 and s["prefix_hit_tokens"] > 0
    assert result.num_aborted > 0 and result.num_finished > result.num_aborted
    assert growth < 0.05, growth
    for prompt, params, ids in result.greedy:
        assert alone(prompt, params) == ids, (prompt, params)
