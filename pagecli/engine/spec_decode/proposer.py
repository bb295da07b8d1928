"""Which running sequences get drafts for the next step, and how many (the policy), and the
n-gram proposer that writes them (`Sequence.draft_token_ids`); the draft model's proposer
(draft.py) shares the policy.

The policy weighs what drafts are expected to give against what they cost, both measured:
- each sequence keeps its drafts' acceptance rate a (a moving average): k drafts then emit
  1 + a + a^2 + ... + a^k tokens a step on average. Prompt lookup's drafts each get their
  own rate instead, by class: the kind of token (one that goes on with a word, one that
  starts a word after a space, anything else) and whether the context it was copied after
  has gone on in more than one way (ngram.py). Each class's rate is a moving average of the
  drafts of that class checked in the sequence (accepted, or the first rejected), the
  sequence's rate until it has one: k drafts then emit 1 + p1 + p1 p2 + ... a step. In the
  spec scenario's JSON replies (a 1.5B coder model, drafts of 7 at most) drafts copied after
  an ambiguous context held 24-37% of the time, the others 66-68%; in its code edits 93-99%
  whatever the class. Side by side with one rate (and 5 drafts at most), two runs each:
  code edit 1.98x -> 2.01x, quote 2.38x -> 2.45x, JSON and open chat unchanged
  (benchmarks/RESULTS.md);
- the engine keeps the time of a step of decodes by its rows, every sequence's new tokens
  together (`VerifyCost`, from the steps without a prefill): r rows cost c(r). On a CPU whose
  kernels are bound by arithmetic, c grows with every row; where the weights' bytes dominate,
  it stays nearly flat. A draft model's forward passes are part of the step's time, so they
  count too.
The step's drafts are chosen together (`allocate`): of the decoding sequences' possible
drafts, taken in the order of the tokens each is expected to add (a sequence's first draft
before its second), the prefix with the most expected tokens per second, c(rows) its cost;
none where no prefix beats the step without drafts by MIN_GAIN. So one sequence alone gets
the k of draft_min..num_speculative_tokens with the best tokens per unit of cost, and a
batch whose rows already fill the machine gets none: each of its draft rows costs about a
row of its own. A sequence that could draft but gets none waits 1, 2, 4 ... steps (up to
the longest back-off, below) before it tries draft_min drafts again (a probe), which
teaches the policy its acceptance; the back-off ends when the estimates, with that
acceptance, say its drafts pay in the next step. A probe is skipped (and the sequence waits
the longest back-off) where not even drafts that are all accepted would pay in its step at the
measured costs: a batch whose rows fill the machine, or a draft model dearer than what it
saves (whose probe would first run the sequence's prompt through the draft model).

The longest back-off is the proposer's `max_cooldown` steps for each decoding sequence of
the step, MAX_COOLDOWN_STEPS at most, so that probes whose drafts are all rejected add
about one row in `max_cooldown` steps to the batch, whatever its size. A draft model's is
MAX_COOLDOWN_STEPS: its probe first runs the tokens it skipped through the draft model.
Prompt lookup's probe costs one verify row and nothing to make, and the acceptance of its
drafts swings with the text (a JSON reply's structure against the names it copies), so its
is NGRAM_MAX_COOLDOWN_STEPS: a sequence alone whose every probe is rejected checks one draft
in 10 steps, which costs c(2) / c(1) - 1 (0.2 on 2 cores of an AVX-512 Xeon for a 1.5B
model) over 10 steps, 2%; from 4 decoding sequences on, the wait is MAX_COOLDOWN_STEPS. On
the spec scenario's replies (3 prompts a workload, 256 tokens at most) at that machine's
costs, the shorter back-off gave open chat 1.10x against 1.05x and JSON extraction 1.08x
against 1.07x, and changed neither code edit nor quote (benchmarks/spec_lookup_bound.py
--max-cooldown 8,32); 4 requests together with 8 steps at most ran at 0.96x against 0.98x
with 32 (benchmarks/spec_batch.py, benchmarks/RESULTS.md), hence the scaling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagecli.config import SpeculativeConfig
from pagecli.engine.scheduler import SampledTokens, ScheduledBatch
from pagecli.engine.sequence import Sequence, SequenceStatus
from pagecli.engine.spec_decode.ngram import NgramIndex
from pagecli.engine.structured import forced_tokens

# Past this many running sequences no draft is proposed, whatever the measured costs: a step
# of that many rows is bound by arithmetic on any CPU, and probing it would cost full steps.
MAX_SPECULATING_SEQS = 8
MAX_COOLDOWN_STEPS = 32
NGRAM_MAX_COOLDOWN_STEPS = 8
ACCEPTANCE_PRIOR = 0.7  # a new sequence's assumed acceptance rate, until it has drafts checked
SMOOTHING = 0.3  # weight of the newest observation in the moving averages
MIN_GAIN = 1.05  # drafts must promise this many more tokens per unit of step time


@dataclass
class VerifyCost:
    """Seconds of a step of decodes (no prefill) by its rows, moving averages."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def estimate(self, rows: int) -> float | None:
        """c(rows): measured, else interpolated between the measured row counts, else
        extended past them by their mean growth per row (flat from a single one: not
        measured yet, so worth trying); None before any step is measured."""
        if rows in self.seconds:
            return self.seconds[rows]
        if not self.seconds:
            return None
        known = sorted(self.seconds.items())
        below = max((p for p in known if p[0] < rows), default=None)
        above = min((p for p in known if p[0] > rows), default=None)
        if below is not None and above is not None:
            t = (rows - below[0]) / (above[0] - below[0])
            return below[1] + t * (above[1] - below[1])
        (r0, s0), (r1, s1) = known[0], known[-1]
        slope = (s1 - s0) / (r1 - r0) if r1 > r0 else 0.0
        if above is None:
            return s1 + slope * (rows - r1)
        # below the smallest: never under that step's cost per row
        return max(s0 + slope * (rows - r0), s0 * rows / r0)

    def ratio(self, rows: int, base: int = 1) -> float:
        """c(rows) / c(base); 1.0 before any step is measured."""
        cost, base_cost = self.estimate(rows), self.estimate(base)
        return 1.0 if cost is None or base_cost is None else cost / base_cost


@dataclass
class SpecState:
    """One sequence's proposer state."""

    index: NgramIndex | None  # prompt lookup's (None for a draft model)
    acceptance: float = ACCEPTANCE_PRIOR  # of its drafts, a moving average
    cooldown: int = 0  # the length of the current back-off
    wait: int = 0  # steps left before it proposes again
    probe: bool = False  # the next proposal tries draft_min drafts whatever the estimate
    rates: dict[tuple[str, bool], float] = field(default_factory=dict)  # prompt lookup's, by class
    classes: list[tuple[str, bool]] = field(default_factory=list)  # of the drafts last proposed


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens that k drafts are expected to add to a step's one: a + a^2 + ... + a^k."""
    return sum(acceptance**j for j in range(1, k + 1))


class Proposer:
    """The policy (module docstring): which decoding sequences get how many drafts. A
    proposer writes them (`drafts`), or reserves their places where it can only make them
    once the step's slots are allocated (`prepare`, before the forward pass)."""

    # the longest back-off, in steps, for each decoding sequence (module docstring)
    max_cooldown = MAX_COOLDOWN_STEPS

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.cost = VerifyCost()

    def new_state(self) -> SpecState:
        return SpecState(None)

    def drafts(self, seq: Sequence, k: int) -> list[int]:
        """Up to k drafts to follow `seq`'s tokens."""
        raise NotImplementedError

    def draft_rates(self, seq: Sequence, drafts: list[int]) -> list[float]:
        """The chance that each of `drafts` holds once those before it have: the sequence's
        acceptance rate for every one."""
        return [seq.spec.acceptance] * len(drafts)

    def prepare(self, batch: ScheduledBatch) -> float:
        """Work due before the step's forward pass; the seconds of it that the policy must
        not count as the cost of checking drafts (a draft model catching up on a prompt)."""
        return 0.0

    def observe(self, batch: ScheduledBatch, samples: list[SampledTokens], seconds: float) -> None:
        """Learn from a step: its cost by rows, and each checked sequence's acceptance."""
        if batch.decodes and not batch.prefills:
            self.cost.observe(sum(item.num_new_tokens for item in batch.decodes), seconds)
        for item, sampled in zip(batch.seqs, samples):
            state = item.seq.spec
            if not item.draft_token_ids or state is None:
                continue
            rate = sampled.num_accepted / len(item.draft_token_ids)
            state.acceptance += SMOOTHING * (rate - state.acceptance)

    def allocate(self, candidates: list[list[float]], rows: int, tokens: float) -> list[int]:
        """Drafts for each candidate (the chance that each of its possible drafts holds once
        those before it have: `draft_rates`) in a step that has `rows` rows and is expected to
        emit `tokens` tokens without them: the prefix of all possible drafts, in the order of
        their expected tokens per row (a candidate's first draft_min together, then one at a
        time), with the most tokens per unit of c(rows); zeros where none beats the step
        without drafts by MIN_GAIN."""
        low = self.config.draft_min
        steps = []  # (expected tokens per row, candidate, rows, expected tokens)
        for i, rates in enumerate(candidates):
            if len(rates) < low:
                continue
            held, reach = [], 1.0  # held[j]: the chance that drafts 0..j all hold
            for rate in rates:
                reach *= rate
                held.append(reach)
            first = sum(held[:low])
            steps.append((first / low, i, low, first))
            steps += [(chance, i, 1, chance) for chance in held[low:]]
        # stable: a candidate's drafts stay in order (their chances never grow along it)
        steps.sort(key=lambda step: -step[0])
        base = rows  # c(rows) / c(base): the cost of the drafts' rows in steps without them
        best_rate, best_taken = MIN_GAIN * tokens, 0
        for taken, (_, _, more_rows, more_tokens) in enumerate(steps, 1):
            rows += more_rows
            tokens += more_tokens
            rate = tokens / self.cost.ratio(rows, base)
            if rate > best_rate:
                best_rate, best_taken = rate, taken
        counts = [0] * len(candidates)
        for _, i, more_rows, _ in steps[:best_taken]:
            counts[i] += more_rows
        return counts

    def propose(self, running: list[Sequence]) -> None:
        """Drafts for the decoding sequences among `running` (none while more than
        MAX_SPECULATING_SEQS run, or before a request's samples are forked), chosen for
        the step together (`allocate`). A structured-output sequence's drafts are the tokens
        its grammar forces, whatever the proposer: they cost nothing to make and are rarely
        rejected."""
        if len(running) > MAX_SPECULATING_SEQS:
            return
        config = self.config
        decoding = [
            seq
            for seq in running
            if seq.status is SequenceStatus.RUNNING
            and seq.num_uncomputed_tokens == 1
            and not seq.pending_fork
        ]
        rows, tokens = len(decoding), float(len(decoding))  # the step without other drafts
        longest = min(MAX_COOLDOWN_STEPS, self.max_cooldown * max(1, len(decoding)))
        choosing: list[tuple[Sequence, list[int]]] = []  # sequences the step's costs decide
        for seq in decoding:
            if seq.matcher is not None:
                seq.draft_token_ids = forced_tokens(seq.matcher, config.num_speculative_tokens)
                rows += len(seq.draft_token_ids)
                tokens += len(seq.draft_token_ids)
                continue
            if seq.spec is None:
                seq.spec = self.new_state()
                if not self.cost.seconds:
                    continue  # its first decode runs without drafts: a step's time, measured
            state = seq.spec
            if state.wait:
                state.wait -= 1
                continue
            if state.probe:
                drafts = self.drafts(seq, config.draft_min)
                if len(drafts) < config.draft_min:
                    state.probe = False
                elif not self.allocate([[1.0] * config.num_speculative_tokens], rows, tokens)[0]:
                    # not even drafts that are all accepted (as many as allowed) would pay in
                    # this step at the measured costs: what the probe would learn is of no use
                    state.wait = state.cooldown = longest
                else:
                    state.probe = False
                    seq.draft_token_ids = drafts
                    rows += len(drafts)
                    tokens += expected_tokens(state.acceptance, len(drafts))
                continue
            choosing.append((seq, self.drafts(seq, config.num_speculative_tokens)))
        counts = self.allocate(
            [self.draft_rates(seq, drafts) for seq, drafts in choosing], rows, tokens
        )
        for (seq, drafts), k in zip(choosing, counts):
            if k:  # drafting pays at the measured costs: any back-off is over
                seq.draft_token_ids = drafts[:k]
                seq.spec.cooldown = 0
            elif len(drafts) >= config.draft_min:  # no pay in this step: back off, then probe
                state = seq.spec
                state.cooldown = min(longest, 2 * state.cooldown or 1)
                state.wait, state.probe = state.cooldown, True


def token_kind(text: str) -> str:
    """A token's kind by its text: "word" for one that goes on with a word (its first
    character a letter, a digit or an underscore), "spaced" for one that starts a word after
    a space, else "other" (punctuation, line breaks, special tokens)."""
    if text[:1].isalnum() or text[:1] == "_":
        return "word"
    if text[:1] == " " and (text[1:2].isalnum() or text[1:2] == "_"):
        return "spaced"
    return "other"


class NgramProposer(Proposer):
    """Prompt-lookup drafts for every decoding sequence, as many as pay (module docstring).
    `token_text` gives a token's text (the tokenizer's); without it every draft is of one
    kind. `special` says which tokens are the tokenizer's special ones (a chat template's
    `<|im_end|>`, `<|im_start|>`, EOS): a copy stops before them. The reply's first token
    often ends the user's message too (a closing code fence, a full stop), and its longest
    match is then that end, followed by the template's tail: copied, those drafts are all
    rejected, and the sequence's rate (ACCEPTANCE_PRIOR down to half) holds a quote's next
    8 steps to 1-4 drafts (benchmarks/RESULTS.md). An EOS at the end of a copy is not lost:
    the step that checks the drafts before it samples it."""

    max_cooldown = NGRAM_MAX_COOLDOWN_STEPS

    def __init__(
        self,
        config: SpeculativeConfig,
        token_text: Callable[[int], str] | None = None,
        special: Callable[[int], bool] | None = None,
    ) -> None:
        super().__init__(config)
        self.token_text = token_text
        self.special = special
        self._kinds: dict[int, str] = {}

    def new_state(self) -> SpecState:
        config = self.config
        return SpecState(NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max))

    def kind(self, token: int) -> str:
        """token_kind's, or "special" for the tokenizer's special tokens."""
        kind = self._kinds.get(token)
        if kind is None:
            if self.special is not None and self.special(token):
                kind = "special"
            else:
                kind = token_kind(self.token_text(token)) if self.token_text else "other"
            self._kinds[token] = kind
        return kind

    def drafts(self, seq: Sequence, k: int) -> list[int]:
        state = seq.spec
        found = state.index.lookup(seq.token_ids, k)
        state.classes = []
        if found is None:
            return []
        for token, ambiguous in zip(found.drafts, found.ambiguous, strict=True):
            kind = self.kind(token)
            if kind == "special":
                break
            state.classes.append((kind, ambiguous))
        return found.drafts[: len(state.classes)]

    def draft_rates(self, seq: Sequence, drafts: list[int]) -> list[float]:
        state = seq.spec
        rates = [state.rates.get(c, state.acceptance) for c in state.classes[: len(drafts)]]
        return rates + [state.acceptance] * (len(drafts) - len(rates))

    def observe(self, batch: ScheduledBatch, samples: list[SampledTokens], seconds: float) -> None:
        super().observe(batch, samples, seconds)
        for item, sampled in zip(batch.seqs, samples):
            state = item.seq.spec
            if not item.draft_token_ids or state is None:
                continue
            # the drafts checked: those accepted, and the first rejected
            checked = min(len(item.draft_token_ids), sampled.num_accepted + 1)
            for j, c in enumerate(state.classes[:checked]):
                rate = state.rates.get(c, state.acceptance)
                state.rates[c] = rate + SMOOTHING * ((j < sampled.num_accepted) - rate)
