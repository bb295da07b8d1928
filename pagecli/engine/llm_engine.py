"""LLMEngine: add_request / step / abort. A step is schedule -> run -> postprocess."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagecli.config import EngineConfig
from pagecli.engine.block_manager import BlockManager
from pagecli.engine.dtype_choice import choose_dtype
from pagecli.engine.executor import Executor
from pagecli.engine.scheduler import Scheduler
from pagecli.engine.sequence import FinishReason, Sequence
from pagecli.engine.spec_decode.proposer import NgramProposer, Proposer
from pagecli.engine.stats import EngineStats, StepTimer
from pagecli.engine.structured import CompiledGrammar, GrammarCompiler, StructuredOutputError
from pagecli.errors import GrammarRejected, RequestError
from pagecli.loader.hf_config import load_hf_config
from pagecli.loader.resolve import ModelLoadError, resolve_model
from pagecli.loader.weight_plan import quantizes
from pagecli.models.registry import UnsupportedModelError, model_class
from pagecli.outputs import CompletionOutput, RequestOutput
from pagecli.sampling_params import SamplingParams, StructuredOutputs
from pagecli.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)  # sample index -> chars reported
    first_token_time: float | None = None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: no CUDA device is available")
    return torch.device(device)


class LLMEngine:
    """The in-process engine: continuous batching over a paged KV cache."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source = resolve_model(config.model)
        self.hf_config = load_hf_config(self.source)
        try:  # an unsupported architecture or config fails before any loading
            model_class(self.hf_config)
        except UnsupportedModelError as exc:
            raise ModelLoadError(f"{self.source.name}: {exc}") from None
        self.device = resolve_device(config.device)
        quantized = quantizes(self.source, config.quantization, self.device, config.load_format)
        self.dtype_choice = choose_dtype(config.dtype, self.device, quantized)  # and why
        self.dtype = self.dtype_choice.dtype
        self.max_model_len = self._max_model_len()
        self.tokenizer = (
            Tokenizer(self.source.path, self.source.name, config.chat_template)
            if self.source.has_tokenizer
            else None
        )
        # speculative decoding's proposer (engine/spec_decode/), when configured; a draft
        # model is checked before the target's cache is sized (both share its budget)
        self.proposer: Proposer | None = None
        draft = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            from pagecli.engine.spec_decode.draft import DraftProposer

            self.proposer = draft = DraftProposer(
                spec,
                config,
                self.tokenizer.vocab() if self.tokenizer is not None else None,
                self.device,
                self.dtype,
                self.max_model_len,
            )
        elif spec is not None:
            tokenizer = self.tokenizer
            token_text = special = None
            if tokenizer is not None:

                def token_text(token: int) -> str:
                    return tokenizer.decode([token], skip_special_tokens=False)

                def special(token: int) -> bool:  # text that decoding drops by default
                    return bool(token_text(token)) and not tokenizer.decode([token])

            self.proposer = NgramProposer(spec, token_text, special)
        self.executor = Executor(
            config,
            self.hf_config,
            self.source,
            self.device,
            self.dtype,
            self.max_model_len,
            draft_block_bytes=draft.block_bytes if draft is not None else 0,
        )
        self.runner = self.executor.runner  # rank 0's: the model, the KV cache, their figures
        if draft is not None:
            draft.load(self.runner)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            model_key=f"{self.source.path}:{self.dtype}",
            num_swap_blocks=self.runner.num_swap_blocks,
            kv_groups=self.runner.kv_groups,
            num_state_slots=self.runner.num_state_slots,
            num_snapshots=self.runner.num_snapshots,
            snapshot_stride=config.state_snapshot_stride,
            num_swap_states=self.runner.num_swap_states,
        )
        self._capacity: int | None = None  # capacity_tokens, counted once
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            self.max_model_len,
            self._eos_token_ids(),
            restart_past=self.runner.model.long_rope_from,
        )
        self._requests: dict[str, _Request] = {}
        self.timer = StepTimer()
        self.grammars = GrammarCompiler(
            self.tokenizer.backend_json if self.tokenizer is not None else None,
            self.hf_config.vocab_size,  # the logits' width: the masks have one bit per logit
            sorted(self.scheduler.eos_token_ids),
            config.grammar_timeout,
        )

    # ---- set-up --------------------------------------------------------------------------

    def _max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        if self.config.max_model_len is not None:
            if self.config.max_model_len > limit:
                raise ValueError(
                    f"max_model_len {self.config.max_model_len} exceeds the model's {limit}"
                )
            return self.config.max_model_len
        return limit

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        value = getattr(self.hf_config, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else value or [])
        gen_file = self.source.path / "generation_config.json"
        if gen_file.is_file():
            import json

            value = json.loads(gen_file.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the KV cache can hold (a hybrid model's window tables hold
        only their window, so its sequences can outgrow num_blocks * block_size)."""
        if self._capacity is None:
            bm = self.block_manager
            limit = max(self.max_model_len, bm.num_blocks * bm.block_size)
            self._capacity = bm.max_sequence_tokens(self.config.max_num_batched_tokens, limit)
        return self._capacity

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """Queue a request. Raises RequestError when it can never fit or its structured
        output cannot compile, ValueError for a duplicate id or bad token ids. `grammar` is
        `params.structured` compiled ahead (compile_grammar, on another thread); without it
        the constraint is compiled here."""
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        max_tokens = self.check_request(prompt_token_ids, params)
        if params.structured is not None and grammar is None:
            grammar = self.compile_grammar(params.structured)
        num_prompt = len(prompt_token_ids)
        generators: list[torch.Generator | None] = [None] * params.n
        if params.seed is not None and not params.greedy:
            generators = [
                torch.Generator(device=self.device).manual_seed(params.seed + i)
                for i in range(params.n)
            ]
        seq = Sequence(
            seq_id=self.scheduler.next_seq_id(),
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=num_prompt,
            sampling_params=params,
            max_tokens=max_tokens,
            generators=generators,
            pending_fork=params.n > 1,
            matcher=grammar.new_matcher() if grammar is not None else None,
            cache_salt=self.runner.cache_salt(num_prompt),
        )
        self._requests[request_id] = _Request(
            request_id, prompt, list(prompt_token_ids), params, [seq], time.perf_counter()
        )
        self.scheduler.add(seq)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The request's resolved max_tokens; RequestError when it can never run. Reads only
        settings fixed at start-up, so any thread may call it."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise RequestError("the prompt is empty")
        vocab = self.hf_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        limit = min(self.max_model_len, self.capacity_tokens)
        what = "max_model_len" if limit == self.max_model_len else "the KV cache"
        if params.max_tokens is None:
            if num_prompt >= limit:
                raise RequestError(f"prompt of {num_prompt} tokens does not fit {what} ({limit})")
            return limit - num_prompt
        if num_prompt + params.max_tokens > limit:
            raise RequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"{what} ({limit} tokens)"
            )
        return params.max_tokens

    def compile_grammar(
        self, spec: StructuredOutputs, timeout_s: float | None = None
    ) -> CompiledGrammar:
        """A structured-output constraint compiled against this model's vocabulary, within
        the time limit (config.grammar_timeout); RequestError says why it cannot run. Any
        thread may call it."""
        if self.tokenizer is None:
            raise GrammarRejected("structured outputs need a tokenizer, and this model has none")
        try:
            return self.grammars.compile(spec, timeout_s)
        except StructuredOutputError as exc:
            raise GrammarRejected(str(exc)) from None

    def special_token_ids(self, texts: list[str]) -> dict[str, int]:
        """Those of `texts` that are one special token of this model's vocabulary, by id (a
        tool-call format's tags: its grammars name them as tokens). Any thread may call it."""
        if self.tokenizer is None:
            return {}
        try:
            return self.grammars.special_ids(texts)
        except StructuredOutputError as exc:
            raise GrammarRejected(str(exc)) from None

    def abort_request(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self.scheduler.finish(seq)

    def abort_all(self) -> None:
        """Abort every unfinished request."""
        for request_id in list(self._requests):
            self.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the requests that made progress (finished ones last)."""
        with self.timer.step() as record:
            batch = self.scheduler.schedule()
            if batch.is_empty:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler could not make progress")
                return []
            start = time.perf_counter()
            # a draft model writes the drafts the scheduler made room for; its catch-up
            # with earlier tokens is not the cost of checking drafts
            catch_up = self.proposer.prepare(batch) if self.proposer is not None else 0.0
            samples = self.executor.execute(batch)
            seconds = time.perf_counter() - start - catch_up
            updated = self.scheduler.postprocess(batch, samples)
            if self.proposer is not None:
                self.proposer.observe(batch, samples, seconds)
                self.proposer.propose(self.scheduler.running)
            record(batch, samples)
        return self._outputs(updated)

    def _outputs(self, updated: list[Sequence]) -> list[RequestOutput]:
        touched: dict[str, _Request] = {}
        now = time.perf_counter()
        for seq in updated:
            request = self._requests[seq.request_id]
            if seq not in request.seqs:
                request.seqs.append(seq)
            touched[request.request_id] = request
            if request.first_token_time is None:
                request.first_token_time = now
            self._detokenize(request, seq)
        outputs = []
        for request in touched.values():
            output = self._request_output(request)
            outputs.append(output)
            if output.finished:
                del self._requests[request.request_id]
        return outputs

    def _detokenize(self, request: _Request, seq: Sequence) -> None:
        if self.tokenizer is None:
            return
        detok = request.detokenizers.get(seq.sample_index)
        if detok is None:
            detok = IncrementalDetokenizer(
                self.tokenizer, request.params.skip_special_tokens, request.params.keep_token_ids
            )
            request.detokenizers[seq.sample_index] = detok
        new = seq.output_token_ids[len(detok.token_ids) :]
        stops = request.params.stop
        if not stops:
            detok.add(new)
            return
        longest = max(len(s) for s in stops)
        # one token at a time: a step that appended several (accepted drafts) ends at the
        # token that completes a stop string, as decoding them one by one would
        for i, token_id in enumerate(new):
            before = len(detok.text)
            detok.add([token_id])
            window_start = max(0, before - longest + 1)
            found = [(idx, s) for s in stops if (idx := detok.text.find(s, window_start)) != -1]
            if found:
                idx, stop = min(found)
                detok.text = detok.text[:idx]
                if i + 1 < len(new):  # the tokens after the stop were never decoded
                    keep = seq.num_tokens - (len(new) - i - 1)
                    del seq.token_ids[keep:]
                    del seq.output_logprobs[seq.num_output_tokens :]
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                return

    def _request_output(self, request: _Request) -> RequestOutput:
        completions = []
        holdback = max((len(s) for s in request.params.stop), default=1) - 1
        for seq in sorted(request.seqs, key=lambda s: s.sample_index):
            detok = request.detokenizers.get(seq.sample_index)
            text = detok.text if detok is not None else ""
            if not seq.is_finished and holdback:
                text = text[: max(len(text) - holdback, request.sent.get(seq.sample_index, 0))]
            sent = request.sent.get(seq.sample_index, 0)
            request.sent[seq.sample_index] = len(text)
            completions.append(
                CompletionOutput(
                    index=seq.sample_index,
                    text=text,
                    token_ids=seq.output_token_ids,
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    stop_reason=seq.stop_reason,
                    delta=text[sent:],
                    logprobs=seq.output_logprobs if request.params.logprobs is not None else None,
                )
            )
        finished = len(request.seqs) == request.params.n and all(
            s.is_finished for s in request.seqs
        )
        # Seconds on time.perf_counter()'s clock; latencies are differences of these.
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["first_token_time"] = request.first_token_time
            metrics["time_to_first_token"] = request.first_token_time - request.arrival_time
        if finished:
            metrics["finished_time"] = time.perf_counter()
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            metrics=metrics,
        )

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats.snapshot(self)

    def check_invariants(self) -> None:
        self.block_manager.check_invariants(self.scheduler.all_seqs())

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers now (they also stop when the engine is
        collected or the process exits); a no-op with one rank."""
        self.executor.close()
