"""Tensor parallelism at 2 ranks (1 thread each): greedy parity with transformers for tiny
random-weight checkpoints (safetensors and GGUF; GQA, MHA, MQA with replicated KV heads),
with prefix caching, chunked prefill and preemption in the same run; the shard layout; the
refusal of a split that cannot be made."""

from __future__ import annotations

import os

import pytest
import torch

from pagecli import LLM, SamplingParams
from pagecli.engine.parallel import WorkerFailed
from pagecli.loader.resolve import ModelLoadError
from pagecli.loader.shards import SplitError, plan_shards, take
from pagecli.models.base import WHOLE, Split
from pagecli_kernels.quant_formats import FORMATS as QUANT_FORMATS
from pagecli_kernels.quant_formats import QuantWeight
from tests.engine.test_parity_gguf import hf_from_gguf
from tests.gguf_models import VOCAB as GGUF_VOCAB
from tests.gguf_models import build_tiny_ggufs
from tests.oracle import check_greedy
from tests.tiny_models import COMMON, VOCAB

NEW_TOKENS = 24
TP = dict(tensor_parallel_size=2, num_threads=1, dtype="float32")


def prompts_with_shared_prefixes(seed: int, vocab: int) -> list[list[int]]:
    """Prompts of 1 to 120 tokens; three share a 24-token prefix (prefix-cache hits)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (24,), generator=gen).tolist()
    own = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 5, 30, 70, 120)]
    shared = [prefix + torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 9, 17)]
    return own + shared


def generate_tp(path, prompts, **config):
    """Greedy ids at TP=2, in a batch small enough to chunk prefills and preempt sequences;
    the engine is closed afterwards (its worker process ends)."""
    llm = LLM(str(path), **{**TP, **config})
    shm = os.environ.get("PAGECLI_SHM_COLLECTIVES", "1") != "0"
    assert (llm.engine.runner.tp.shm is not None) == shm
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine.check_invariants()
        stats = llm.engine.stats()
        tp = llm.engine.runner.tp
        one_call = tp.shm is not None and tp.shm.num_in_layers > 0  # the C layers' all-reduces
        worker = llm.engine.runner.parallel.processes[0]
        assert worker.is_alive()
    finally:
        llm.engine.close()
    assert not worker.is_alive()
    return stats, [o.token_ids for o in outputs], one_call


@pytest.fixture(scope="module")
def mha_model(tmp_path_factory):
    """A tiny Llama with as many KV heads as query heads (MHA)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=False)
    torch.manual_seed(77)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("mha")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("arch", "collectives"),
    [("llama3", "shm"), ("llama3", "gloo"), ("qwen2", "shm"), ("qwen3", "shm"), ("mha", "shm")],
)
def test_tp2_parity_with_transformers(arch, collectives, tiny_models, mha_model, monkeypatch):
    """llama3: GQA (4 heads, 2 KV); qwen2: q/k/v biases, tied embeddings; qwen3: q/k norms
    and one KV head, replicated on both ranks; mha: 4 KV heads. The CPU's collectives go
    through shared memory, or all through gloo (PAGECLI_SHM_COLLECTIVES=0)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGECLI_SHM_COLLECTIVES", "0" if collectives == "gloo" else "1")
    path = mha_model if arch == "mha" else tiny_models[arch]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = prompts_with_shared_prefixes(len(arch), VOCAB)
    stats, outputs, one_call = generate_tp(
        path, prompts, block_size=4, num_kv_blocks=48, max_num_batched_tokens=32
    )
    # the layer program sums over the ranks itself (q/k norms too: qwen3); gloo takes the
    # Python loop
    assert one_call == (collectives == "shm")
    assert stats.chunked_prefills > 0
    assert stats.preemptions_recompute > 0
    assert stats.prefix_hit_tokens > 0
    for prompt, ids in zip(prompts, outputs):
        assert len(ids) == NEW_TOKENS
        check_greedy(hf, prompt, ids)


# KV pages: Phi-4's hold every layer; Gemma 3's one layer each (a table per layer type), and
# its window tables give back what they no longer read: 120 of them run short as 48 did
@pytest.mark.parametrize(("name", "pages"), [("gemma3", 120), ("phi4", 48)])
def test_tp2_family_parity_with_transformers(name, pages, family_models):
    """Gemma 3 (sandwich norms, per-head q/k norms, windows) and Phi-4 (q/k/v and gate/up
    fused in the checkpoint itself: each rank reads its rows of every segment) at 2 ranks,
    through the layer program."""
    from transformers import AutoModelForCausalLM

    path = family_models[name]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = prompts_with_shared_prefixes(9, VOCAB)
    stats, outputs, one_call = generate_tp(
        path, prompts, block_size=4, num_kv_blocks=pages, max_num_batched_tokens=32
    )
    assert one_call
    assert stats.chunked_prefills > 0 and stats.preemptions_recompute > 0
    assert stats.prefix_hit_tokens > 0
    for prompt, ids in zip(prompts, outputs):
        check_greedy(hf, prompt, ids)


def test_a_full_width_qk_norm_is_not_split(family_models):
    """OLMo 2's q/k norms span every head; a rank holds some: refused in one line."""
    with pytest.raises(SplitError, match="q/k norms span every head"):
        LLM(str(family_models["olmo2"]), **TP)


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    return build_tiny_ggufs(tmp_path_factory.mktemp("gguf-tp"))


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_tp2_gguf_parity_with_transformers(kind, tiny_ggufs):
    """The file's blocks stay quantized on each rank (q/k/v rows as views of the map, o_proj
    and down_proj columns cut on their 32-value blocks)."""
    path = tiny_ggufs[kind]
    hf = hf_from_gguf(path)
    prompts = prompts_with_shared_prefixes(3, GGUF_VOCAB)
    stats, outputs, one_call = generate_tp(
        path, prompts, block_size=4, num_kv_blocks=48, max_num_batched_tokens=32
    )
    assert one_call
    assert stats.preemptions_recompute > 0 and stats.chunked_prefills > 0
    for prompt, ids in zip(prompts, outputs):
        check_greedy(hf, prompt, ids)


def test_a_k_quant_split_inside_a_block_is_refused(tiny_ggufs):
    """The tiny q4_k file's o_proj has 256 columns in one 256-value block per row: two ranks
    would each need half a block. Refused before any worker starts, naming the sizes."""
    with pytest.raises(SplitError) as info:
        LLM(str(tiny_ggufs["q4_k"]), **TP)
    message = str(info.value)
    assert "--tensor-parallel-size 2" in message and "256-value blocks" in message
    assert "sizes that work: 1)" in message
    assert isinstance(info.value, ModelLoadError) and "\n" not in message


class _Config:
    def __init__(self, heads, kv_heads, head_dim, intermediate, vocab):
        self.num_attention_heads, self.num_key_value_heads = heads, kv_heads
        self.head_dim, self.hidden_size = head_dim, heads * head_dim
        self.intermediate_size, self.vocab_size = intermediate, vocab


def test_shards_follow_kv_head_groups():
    # the default model: 9 query heads in 3 KV-head groups, over 2 ranks: 1 group and 2
    # (the smaller share to rank 0, which also schedules and samples)
    blocks = {"intermediate": 32}
    shards = plan_shards(_Config(9, 3, 64, 1536, 49152), 2, blocks)
    assert [s.q_heads for s in shards] == [(0, 3), (3, 9)]
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 3)]
    assert [s.intermediate for s in shards] == [(0, 768), (768, 1536)]
    assert [s.vocab for s in shards] == [(0, 24576), (24576, 49152)]
    # more ranks than KV heads: each KV head replicated, its group's query heads shared
    shards = plan_shards(_Config(8, 2, 16, 64, 10), 4)
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.vocab for s in shards] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert all(s.vocab_rows == 3 for s in shards)


@pytest.mark.parametrize(
    ("config", "size", "words"),
    [
        (_Config(9, 3, 64, 1536, 49152), 4, "multiple of them"),
        (_Config(8, 2, 16, 1024, 10), 6, "query heads cannot be split"),
        (_Config(4, 4, 16, 96, 10), 4, "MLP's 96 columns in 32-value blocks"),
    ],
)
def test_impossible_splits_name_the_sizes_that_work(config, size, words):
    blocks = {"intermediate": 32}
    with pytest.raises(SplitError) as info:
        plan_shards(config, size, blocks)
    assert words in str(info.value)
    works = str(info.value).split("sizes that work: ")[1].rstrip(")").split(", ")
    for n in map(int, works):
        plan_shards(config, n, blocks)  # each size it names does split


def test_take_slices_blocks_without_cutting_them():
    fmt = QUANT_FORMATS["q8_0"]
    rows, cols = 128, 128
    width = cols // fmt.block_values * fmt.block_bytes
    data = torch.randint(0, 255, (rows, width), dtype=torch.uint8)
    shard = plan_shards(_Config(2, 2, 32, 128, 10), 2, {"intermediate": 32})[1]
    qkv = Split("column", (("q_heads", 32), ("kv_heads", 32), ("kv_heads", 32)))
    gate_up = Split("column", (("intermediate", 1), ("intermediate", 1)))

    def cut(split, parts=None, bias=False):
        return shard.cut(split, parts, bias)

    q = take(shard, cut(qkv, range(0, 1)), "q", QuantWeight(fmt, data, cols))
    assert q.rows == 32 and q.data.data_ptr() == data[32].data_ptr()  # a view of rows 32..64
    up = take(shard, cut(gate_up, range(1, 2)), "up", QuantWeight(fmt, data, cols))
    assert up.rows == 64 and up.data.data_ptr() == data[64].data_ptr()
    down_split = Split("row", (("intermediate", 1),))
    down = take(shard, cut(down_split), "down", QuantWeight(fmt, data[:, :width], cols))
    assert down.cols == 64 and torch.equal(down.data, data[:, width // 2 :])  # 2 whole blocks
    # a fused q/k/v tensor (Phi-3): the rank's rows of each segment, q 32..64, k 96..128,
    # v 160..192 of 192 rows
    fused = torch.arange(192 * 4, dtype=torch.float32).reshape(192, 4)
    mine = take(shard, cut(qkv), "qkv", fused)
    assert torch.equal(mine, torch.cat([fused[32:64], fused[96:128], fused[160:192]]))
    half_block = plan_shards(_Config(4, 4, 8, 128, 10), 2)[1]  # o_proj columns 16..32
    o_split = Split("row", (("q_heads", 8),))
    with pytest.raises(SplitError, match="cut its 32-value blocks"):
        take(half_block, half_block.cut(o_split, None, False), "o", QuantWeight(fmt, data, cols))
    bias = take(shard, cut(o_split, bias=True), "o.bias", torch.ones(4))
    assert torch.equal(bias, torch.zeros(4))  # a row-parallel bias is added once, by rank 0
    norm = torch.ones(4)
    assert take(shard, cut(WHOLE), "norm", norm) is norm
    with pytest.raises(SplitError, match="span every head"):
        shard.cut(Split("none", reason="its q/k norms span every head"), None, False)


def test_one_engine_at_a_time_and_a_dropped_one_is_collected(tiny_models):
    """torch.distributed has one group per process: a second live TP engine is refused in
    one line; a dropped one is collected (its worker stopped) and a new one starts."""
    import gc

    path = str(tiny_models["llama3"])
    first = LLM(path, **TP, num_kv_blocks=16)
    worker = first.engine.runner.parallel.processes[0]
    with pytest.raises(ValueError, match="another tensor-parallel engine runs"):
        LLM(path, **TP, num_kv_blocks=16)
    del first
    gc.collect()
    worker.join(10)
    assert not worker.is_alive()
    with LLM(path, **TP, num_kv_blocks=16) as second:
        out = second.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
        assert len(out[0].token_ids) == 2
        worker = second.engine.runner.parallel.processes[0]
    assert not worker.is_alive()  # closed on leaving the block


def test_a_step_that_fails_on_rank_0_ends_the_group(tiny_models, monkeypatch):
    """A step interrupted on rank 0 (Ctrl-C in a notebook, out of memory) leaves rank 1 in a
    collective rank 0 never reaches: the group ends with it, and later steps say so instead
    of pairing the ranks' collectives wrongly."""
    llm = LLM(str(tiny_models["llama3"]), **TP, num_kv_blocks=32)
    runner = llm.engine.runner
    worker = runner.parallel.processes[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)[0].token_ids) == 4
    forward = runner.model.forward
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:  # the second step: rank 1 is already in it
            raise KeyboardInterrupt
        return forward(*args)

    monkeypatch.setattr(runner.model, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [4, 5, 6]}], params)
    worker.join(10)
    assert not worker.is_alive()
    monkeypatch.setattr(runner.model, "forward", forward)
    with pytest.raises(WorkerFailed, match=r"stopped after a failed step \(KeyboardInterrupt\)"):
        llm.generate([{"prompt_token_ids": [4, 5, 6]}], params)
