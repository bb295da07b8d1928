"""Drafts from a smaller model with the target's tokenizer (`--model-draft`, vLLM's
`{"method": "draft_model", "model": ...}`).

The draft model has a KV cache of its own, with the target's block ids: the same block
tables, the same block size and count, a page of the draft's layers per block. So the block
manager allocates, shares, copies (copy-on-write), swaps and frees one set of blocks for
both models: a step applies its block copies and swaps to the draft's cache too, and rolling
back rejected drafts frees both at once. Both caches come out of one --kv-cache-memory. A
prefix hit shares the target's K/V only: the draft runs for the sequences it drafts for, so
a cached block may lack its K/V, and a new sequence's catch-up writes it (the same values
for the same tokens, in a shared block).

`Sequence.num_draft_computed` counts the tokens whose K/V the draft holds there. The draft
catches up lazily: a sequence's first drafts run its prompt through the draft model (in
chunks of --max-num-batched-tokens), and a sequence that decoded without drafts for a while
runs those tokens first. A recompute preemption resets the count (its blocks are gone), a
swap keeps it (the draft's blocks travel too), and after a step it falls to what the target
accepted: a rejected draft's K/V is overwritten later.

A step with drafts: the policy (proposer.py) reserves k places per sequence, the scheduler
allocates 1 + k slots, then `prepare` runs the draft model k times over the drafting
sequences (the last token, then each draft in turn, over the target's vocabulary) and
writes the drafts into their places before the target checks them. A draft is the draft's
greedy token, or, for a sampled request without a seed under rejection sampling (the
default), a draw from the request's sampler on the draft's logits, kept with that
distribution. A draft is only a guess: the target's sample-and-compare or rejection sampling
(verify.py) decides every emitted token, so the output follows the target whatever the draft
says.

Limits, each refused at start in one line: the draft model runs on the CPU, beside a target
of one rank; it has attention layers only (recurrent layers cannot roll back), and the
target needs a full-attention block table for it to share.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from pagecli.config import EngineConfig, SpeculativeConfig
from pagecli.engine.scheduler import SampledTokens, ScheduledBatch, ScheduledSeq
from pagecli.engine.sequence import Sequence
from pagecli.engine.spec_decode.proposer import Proposer
from pagecli.engine.spec_decode.verify import rejection_sampled
from pagecli.errors import ModelLoadError
from pagecli.layers.sampler import SamplingRow, draw, sampling_probs

PLACEHOLDER = 0  # a reserved draft's id until `prepare` writes it (a valid id either way)


@dataclasses.dataclass
class _DraftView:
    """What the runner's input preparation reads of a sequence, for the draft model: its
    tokens (with the drafts so far), the tokens in the draft's cache, the shared table."""

    token_ids: list[int]
    num_computed_tokens: int
    block_tables: list[list[int]]
    matcher = None  # the draft's rows are never masked

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftProposer(Proposer):
    """k greedy drafts from the draft model for each decoding sequence the policy picks."""

    def __init__(
        self,
        config: SpeculativeConfig,
        engine_config: EngineConfig,
        target_vocab: dict[str, int] | None,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        """Resolve the draft model and check it against the target (its tokenizer's
        vocabulary, `target_vocab`), before the target's cache is sized: `block_bytes` is
        the draft's share of a block id. `load` loads it once the target's cache exists."""
        super().__init__(config)
        from pagecli.loader.hf_config import load_hf_config
        from pagecli.loader.resolve import resolve_model
        from pagecli.models.registry import UnsupportedModelError, model_class

        if engine_config.tensor_parallel_size > 1:
            raise ModelLoadError(
                "a draft model runs beside a target of one rank: drop --tensor-parallel-size "
                "or use n-gram drafts (--spec-type ngram)"
            )
        if device.type != "cpu":
            raise ModelLoadError(
                "a draft model runs on the CPU only so far; use n-gram drafts (--spec-type "
                "ngram) on CUDA"
            )
        self.engine_config = engine_config
        try:
            self.source = resolve_model(config.model)
            self.hf_config = load_hf_config(self.source)
        except ModelLoadError as exc:
            raise ModelLoadError(f"draft model: {exc}") from None
        name = f"draft model {self.source.name}"
        try:
            cls = model_class(self.hf_config)
        except UnsupportedModelError as exc:
            raise ModelLoadError(f"{name}: {exc}") from None
        _check_vocab(name, self.source, target_vocab)
        self.dtype = dtype
        self.max_model_len = max_model_len
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                meta = cls(self.hf_config, max_position=max_model_len)
        except ValueError as exc:
            raise ModelLoadError(f"{name}: {exc}") from None
        finally:
            torch.set_default_dtype(previous)
        if meta.state_layers:
            raise ModelLoadError(
                f"{name}: has recurrent (Gated DeltaNet) layers, whose state cannot roll back "
                "rejected drafts; choose a draft with attention layers only"
            )
        layout = meta.kv_layout()
        elem = torch.tensor([], dtype=dtype).element_size()
        self.block_bytes = sum(
            2 * engine_config.block_size * layer.num_kv_heads * layer.head_dim * elem
            for layer in layout
        )
        self.name = name
        self.runner = None
        self.target_vocab_size = 0
        self.generator: torch.Generator | None = None

    def load(self, target) -> None:
        """Load the draft model with a cache of the target runner's block ids (and swap
        blocks), on the target's threads."""
        from pagecli.engine.model_runner import ModelRunner

        if target.kv_groups.groups[0].window is not None:
            raise ModelLoadError(
                f"{self.name}: the target keeps no full-attention block table for a draft "
                "model to share; use n-gram drafts (--spec-type ngram)"
            )
        config = dataclasses.replace(
            self.engine_config,
            model=self.engine_config.speculative_config.model,
            speculative_config=None,
            num_kv_blocks=target.num_blocks,
            swap_space=0.0,
            hybrid_kv_cache=False,  # one table: the target's full-attention one
            num_threads=target.num_threads,
            chat_template=None,
        )
        try:
            self.runner = ModelRunner(
                config, self.hf_config, self.source, target.device, self.dtype, self.max_model_len
            )
        except ModelLoadError as exc:
            raise ModelLoadError(f"draft model: {exc}") from None
        self.runner.allocate_swap(target.num_swap_blocks)
        self.target_vocab_size = target.vocab_size
        self.generator = target.generator  # rejection sampling's drafts: the engine's draws

    # ---- the policy's hooks ----------------------------------------------------------------

    def drafts(self, seq: Sequence, k: int) -> list[int]:
        """k places, filled in `prepare` once their slots are allocated."""
        return [PLACEHOLDER] * k

    def observe(self, batch: ScheduledBatch, samples: list[SampledTokens], seconds: float) -> None:
        super().observe(batch, samples, seconds)
        for item in batch.decodes:  # the draft's K/V of rejected drafts is stale
            seq = item.seq
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)

    def prepare(self, batch: ScheduledBatch) -> float:
        """Apply the step's block copies and swaps to the draft's cache, then write the
        drafts of every decode that carries some. Returns the seconds spent catching the
        draft's cache up with a sequence more than two tokens behind (a prompt)."""
        runner = self.runner
        runner.copy_blocks(batch.swap_out, batch.swap_in, batch.block_copies)
        # a structured-output sequence's drafts are its grammar's forced tokens
        items = [i for i in batch.decodes if i.draft_token_ids and i.seq.matcher is None]
        if not items:
            return 0.0
        start = time.perf_counter()
        self._catch_up([item.seq for item in items])
        caught_up = time.perf_counter() - start
        # round 0 feeds what the draft lacks of each sequence: its last token, and after a
        # step that accepted every draft the last draft too; each later round feeds the
        # newest draft. Every round draws one draft per sequence still drafting.
        drafts: list[list[int]] = [[] for _ in items]
        drawn = [rejection_sampled(item.seq, self.config) for item in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        for j in range(max(len(item.draft_token_ids) for item in items)):
            active = [i for i, item in enumerate(items) if len(item.draft_token_ids) > j]
            order, decodes, prefills = [], [], []
            for i in active:
                seq = items[i].seq
                tokens = seq.token_ids + drafts[i]
                computed = seq.num_draft_computed if j == 0 else len(tokens) - 1
                item = ScheduledSeq(self._view(seq, tokens, computed), len(tokens) - computed)
                if item.num_new_tokens == 1:
                    decodes.append(item)
                    order.insert(len(decodes) - 1, i)  # the runner's rows: decodes first
                else:
                    prefills.append(item)
                    order.append(i)
            step = ScheduledBatch(decodes=decodes, prefills=prefills)
            logits = runner.forward(step, runner.prepare_step(step))
            ids = logits[:, : self.target_vocab_size].argmax(dim=-1).tolist()
            for row, (i, token) in enumerate(zip(order, ids)):
                if drawn[i]:
                    q = self._distribution(logits[row], items[i].seq, drafts[i])
                    token = int(draw(q, self.generator))
                    probs[i].append(q)
                drafts[i].append(token)
        for item, made, made_probs in zip(items, drafts, probs):
            item.draft_token_ids[:] = made
            item.draft_probs = torch.stack(made_probs) if made_probs else None
            # fed: every token before the last draft
            item.seq.num_draft_computed = item.seq.num_tokens + len(made) - 1
        return caught_up

    def _distribution(self, logits: torch.Tensor, seq: Sequence, drafts: list[int]) -> torch.Tensor:
        """q: the request's sampler's distribution over the target's vocabulary on one row of
        the draft's logits, its penalties over the tokens so far and the drafts before it."""
        width = self.target_vocab_size
        row = logits[:width].float()
        if row.shape[0] < width:  # a draft with fewer output rows never proposes the rest
            row = torch.cat([row, row.new_full((width - row.shape[0],), float("-inf"))])
        sampling = SamplingRow(
            seq.sampling_params, [None], seq.prompt_token_ids, seq.output_token_ids + drafts
        )
        return sampling_probs(row, sampling)

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Run the tokens of each sequence up to its last two through the draft model, from
        `num_draft_computed`, in prefill chunks within --max-num-batched-tokens."""
        budget = self.engine_config.max_num_batched_tokens
        while True:
            chunks, used = [], 0
            for seq in seqs:
                start = min(seq.num_draft_computed, seq.num_computed_tokens)
                seq.num_draft_computed = start
                todo = seq.num_tokens - 2 - start
                if todo > 0 and used < budget:
                    n = min(todo, budget - used)
                    chunks.append((seq, start, n))
                    used += n
            if not chunks:
                return
            # each chunk ends short of its sequence's last token: nothing is sampled
            prefills = [
                ScheduledSeq(self._view(seq, seq.token_ids, start), n) for seq, start, n in chunks
            ]
            step = ScheduledBatch(prefills=prefills)
            self.runner.forward(step, self.runner.prepare_step(step))
            for seq, start, n in chunks:
                seq.num_draft_computed = start + n

    @staticmethod
    def _view(seq: Sequence, tokens: list[int], computed: int) -> _DraftView:
        return _DraftView(tokens, computed, [seq.block_tables[0]])


def _check_vocab(name: str, source, target_vocab: dict[str, int] | None) -> None:
    """One line where the draft's tokenizer maps any token to another id than the
    target's (its drafts would be other words)."""
    from pagecli.tokenizer import load_vocab

    if target_vocab is None or not source.has_tokenizer:
        raise ModelLoadError(
            f"{name}: a draft model and its target both need a tokenizer, to check they share one"
        )
    vocab = load_vocab(source.path, name)
    if vocab == target_vocab:
        return
    for token in sorted(set(vocab) | set(target_vocab)):
        if vocab.get(token) != target_vocab.get(token):
            ids = f"{vocab.get(token)} in the draft, {target_vocab.get(token)} in the target"
            raise ModelLoadError(
                f"{name}: its tokenizer is not the target's (token {token!r}: {ids}); a draft "
                "model must share the target's tokenizer"
            )
