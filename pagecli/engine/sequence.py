"""Sequence: one sample's tokens, status, block table and counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from pagecli.outputs import TokenLogprob
from pagecli.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)
class Sequence:
    """One sample of one request. With `n > 1` the request's samples are forked after prefill.

    `num_computed_tokens` counts the tokens whose K/V are in the cache; the rest of `token_ids`
    still has to run through the model (the prompt at first, then the newest sampled token).
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never past max_model_len
    sample_index: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    # One block table per KV cache group (engine/kv_groups.py; one group for a uniform
    # model); a window group's entries before its window are NULL_BLOCK (-1).
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # Per-sample random generators of a seeded request (None: the engine's generator). A
    # sequence pending its fork holds all n; after the fork each sample keeps its own.
    generators: list[torch.Generator | None] = field(default_factory=lambda: [None])
    # True while this one sequence stands for all n > 1 samples of its request: from
    # admission until its first sampled tokens, when the scheduler forks the other samples.
    pending_fork: bool = False
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when params ask
    # The llguidance matcher of a structured-output request, advanced with every sampled
    # token (engine/structured.py); None: unconstrained.
    matcher: Any = None
    # Mixed into its blocks' prefix hashes: sequences whose K/V differ for the same tokens
    # (a LongRoPE model rotates a long prompt with other factors) never share blocks.
    cache_salt: int = 0
    # A model with recurrent layers (Gated DeltaNet): the state slot this sequence's state
    # lives in, and the slots kept for the samples it forks (n > 1); None: none yet
    state_slot: int | None = None
    reserved_state_slots: list[int] = field(default_factory=list)
    restore_snapshot: int | None = None  # a prefix hit's state snapshot, until restored
    # Speculative decoding (engine/spec_decode/): the tokens proposed to follow `token_ids`,
    # checked in the next step; never part of `token_ids` until accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    spec: Any = None  # the proposer's per-sequence state (SpecState), made at first use
    # A draft model's cache (spec_decode/draft.py) shares the block tables: the tokens whose
    # K/V it holds there, never more than num_computed_tokens after a step; reset with it
    num_draft_computed: int = 0

    @property
    def block_table(self) -> list[int]:
        """The first group's block table (the full-attention layers', where there are any)."""
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, seq_id: int, sample_index: int) -> Sequence:
        """A new sample sharing this one's tokens so far (the block table is shared by the
        block manager, not here)."""
        return Sequence(
            seq_id=seq_id,
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            sampling_params=self.sampling_params,
            max_tokens=self.max_tokens,
            sample_index=sample_index,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            block_hashes=list(self.block_hashes),
            generators=[
                self.generators[sample_index] if sample_index < len(self.generators) else None
            ],
            output_logprobs=list(self.output_logprobs),
            matcher=self.matcher.deep_copy() if self.matcher is not None else None,
            cache_salt=self.cache_salt,
        )
