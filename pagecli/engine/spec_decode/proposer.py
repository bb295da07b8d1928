"""Which running sequences get drafts for the next step, and how many (the policy), and the
n-gram proposer that writes them (`Sequence.draft_token_ids`); the draft model's proposer
(draft.py) shares the policy.

The policy weighs what k drafts are expected to give against what they cost, both measured:
- each sequence keeps its drafts' acceptance rate a (a moving average): k drafts then emit
  1 + a + a^2 + ... + a^k tokens a step on average;
- the engine keeps the time of a decode step by its number of rows (`VerifyCost`, from steps
  of one sequence and no prefill): k drafts make a step of k + 1 rows cost r(k + 1) one-row
  steps. On a CPU whose multi-row kernels are slower per row than its one-row kernel, r grows
  fast; where the weights' bytes dominate, it stays near 1.
  A draft model's k forward passes are part of the step's time, so they count too.
k is the one of draft_min..num_speculative_tokens with the best tokens per unit of cost, and
none where no k beats decoding alone; such a sequence waits 1, 2, 4 ... steps
(MAX_COOLDOWN_STEPS at most) before it tries draft_min drafts again. The back-off ends when
a probe's drafts are accepted and the estimates then say drafting pays: good guesses at a
cost that never pays are probed once per MAX_COOLDOWN_STEPS steps. A draft model's probe is
dear (its first drafts run the sequence's prompt through the draft model): it probes only
while drafts that are all accepted would pay at the measured costs, so where its steps cost
more than they can give, speculation stays off after the costs are first measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagecli.config import SpeculativeConfig
from pagecli.engine.scheduler import SampledTokens, ScheduledBatch
from pagecli.engine.sequence import Sequence, SequenceStatus
from pagecli.engine.spec_decode.ngram import NgramIndex
from pagecli.engine.structured import forced_tokens

# Past this many running sequences a step is no longer bound by reading the weights once:
# each draft row then costs about what a sequence's own row costs, and speculation stops.
MAX_SPECULATING_SEQS = 8
MAX_COOLDOWN_STEPS = 32
ACCEPTANCE_PRIOR = 0.7  # a new sequence's assumed acceptance rate, until it has drafts checked
SMOOTHING = 0.3  # weight of the newest observation in the moving averages
MIN_GAIN = 1.05  # drafts must promise this many more tokens per unit of step time


@dataclass
class VerifyCost:
    """Seconds of a decode step by its rows (one sequence, no prefill), moving averages."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def ratio(self, rows: int) -> float:
        """A step of `rows` rows in one-row steps: measured, else interpolated between the
        measured row counts (from 1 row at 1.0), else 1.0 (not measured yet: worth trying)."""
        base = self.seconds.get(1)
        if base is None or rows == 1:
            return 1.0
        known = sorted((r, s / base) for r, s in self.seconds.items())
        if rows in self.seconds:
            return self.seconds[rows] / base
        below = max((p for p in known if p[0] < rows), default=(1, 1.0))
        above = min((p for p in known if p[0] > rows), default=None)
        if above is None:  # past the largest measured: the same growth per row
            if below[0] == 1:
                return 1.0
            slope = (below[1] - 1.0) / (below[0] - 1)
            return below[1] + slope * (rows - below[0])
        t = (rows - below[0]) / (above[0] - below[0])
        return below[1] + t * (above[1] - below[1])


@dataclass
class SpecState:
    """One sequence's proposer state."""

    index: NgramIndex | None  # prompt lookup's (None for a draft model)
    acceptance: float = ACCEPTANCE_PRIOR  # of its drafts, a moving average
    cooldown: int = 0  # the length of the current back-off
    wait: int = 0  # steps left before it proposes again
    probe: bool = False  # the next proposal tries draft_min drafts whatever the estimate


class Proposer:
    """The policy (module docstring): which decoding sequences get how many drafts. A
    proposer writes them (`drafts`), or reserves their places where it can only make them
    once the step's slots are allocated (`prepare`, before the forward pass)."""

    # True where a probe costs more than its step (a draft model catches up on the sequence
    # first): such a proposer probes only while drafts all accepted would pay
    dear_probes = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.cost = VerifyCost()

    def new_state(self) -> SpecState:
        return SpecState(None)

    def drafts(self, seq: Sequence, k: int) -> list[int]:
        """Up to k drafts to follow `seq`'s tokens."""
        raise NotImplementedError

    def prepare(self, batch: ScheduledBatch) -> float:
        """Work due before the step's forward pass; the seconds of it that the policy must
        not count as the cost of checking drafts (a draft model catching up on a prompt)."""
        return 0.0

    def observe(self, batch: ScheduledBatch, samples: list[SampledTokens], seconds: float) -> None:
        """Learn from a step: its cost by rows, and each checked sequence's acceptance."""
        if len(batch.decodes) == 1 and not batch.prefills:
            self.cost.observe(batch.decodes[0].num_new_tokens, seconds)
        for item, sampled in zip(batch.seqs, samples):
            state = item.seq.spec
            if not item.draft_token_ids or state is None:
                continue
            rate = sampled.num_accepted / len(item.draft_token_ids)
            state.acceptance += SMOOTHING * (rate - state.acceptance)
            if sampled.num_accepted and self.choose_k(state.acceptance):
                state.cooldown = 0  # accepted, and at a cost that pays: back-off over

    def choose_k(self, acceptance: float) -> int:
        """The draft count with the most tokens per unit of step time; 0 where none beats a
        step without drafts by MIN_GAIN."""
        config = self.config
        best_k, best_gain = 0, MIN_GAIN
        expected = 1.0  # tokens a step emits with k drafts: 1 + a + ... + a^k
        for k in range(1, config.num_speculative_tokens + 1):
            expected += acceptance**k
            if k < config.draft_min:
                continue
            gain = expected / self.cost.ratio(k + 1)
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k

    def propose(self, running: list[Sequence]) -> None:
        """Drafts for the decoding sequences among `running` (none while more than
        MAX_SPECULATING_SEQS run, or before a request's samples are forked). A
        structured-output sequence's drafts are the tokens its grammar forces, whatever the
        proposer: they cost nothing to make and are rarely rejected."""
        if len(running) > MAX_SPECULATING_SEQS:
            return
        config = self.config
        for seq in running:
            if (
                seq.status is not SequenceStatus.RUNNING
                or seq.num_uncomputed_tokens != 1
                or seq.pending_fork
            ):
                continue
            if seq.matcher is not None:
                seq.draft_token_ids = forced_tokens(seq.matcher, config.num_speculative_tokens)
                continue
            if seq.spec is None:
                seq.spec = self.new_state()
                if 1 not in self.cost.seconds:
                    continue  # its first decode runs alone: the one-row step's time
            state = seq.spec
            if state.wait:
                state.wait -= 1
                continue
            if state.probe and self.dear_probes and not self.choose_k(1.0):
                # not even drafts that are all accepted would pay at the measured costs
                state.wait = state.cooldown = MAX_COOLDOWN_STEPS
                continue
            k = config.draft_min if state.probe else self.choose_k(state.acceptance)
            state.probe = False
            if k == 0:  # drafts would not pay now: back off, then probe
                state.cooldown = min(MAX_COOLDOWN_STEPS, 2 * state.cooldown or 1)
                state.wait, state.probe = state.cooldown, True
                continue
            drafts = self.drafts(seq, k)
            seq.draft_token_ids = drafts if len(drafts) >= config.draft_min else []


class NgramProposer(Proposer):
    """Prompt-lookup drafts for every decoding sequence, as many as pay (module docstring)."""

    def new_state(self) -> SpecState:
        config = self.config
        return SpecState(NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max))

    def drafts(self, seq: Sequence, k: int) -> list[int]:
        return seq.spec.index.propose(seq.token_ids, k)
