"""An engine of one sequence at a time (`max_num_seqs` 1: chat, bench's latency and spec
scenarios) runs every step under the integer paths where the process leaves them to the CPU
(engine/spec_decode/invariance.py): each row then has the bits it has under `--kernels
int_dots=on`; an engine of several sequences keeps the process's choices."""

from __future__ import annotations

import pytest

from pagecli import LLM, SamplingParams
from pagecli.engine.spec_decode.invariance import verify_kernel_settings
from pagecli_kernels import quant_cpu
from pagecli_kernels.settings import KernelSettings, kernel_settings

PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


def int_paths() -> bool:
    return quant_cpu.library() is not None and quant_cpu.int_dots()


def test_the_choice_of_a_step():
    """One sequence at a time: int_dots on for every step, with drafts or not, where it was
    left to the CPU and the CPU has an integer path; the user's own choice kept; several
    sequences: nothing changes without drafts."""
    auto = KernelSettings()
    for rows, drafts in ((1, False), (6, False), (5, True)):
        one = verify_kernel_settings(auto, rows, drafts, one_stream=True)
        assert one.int_dots == ("on" if int_paths() else "auto")
        off = KernelSettings(int_dots="off")
        assert verify_kernel_settings(off, rows, drafts, one_stream=True).int_dots == "off"
    assert verify_kernel_settings(auto, 1, False) == auto


def logprobs(**engine) -> list:
    llm = LLM(None, **engine)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5)
    (out,) = llm.generate([PROMPT], params)
    return [(lp.logprob, lp.top) for lp in out.outputs[0].logprobs]


def test_one_sequence_at_a_time_has_the_bits_of_the_integer_paths():
    """The default model (Q4_1 projections, a Q8_0 head): decoded by an engine of one
    sequence, every logprob has the bits of an engine of two under int_dots=on; where that
    choice changes Q4_1's kernels (AVX2), they are not the bits of an engine of two under the
    CPU's own choice."""
    if not int_paths():
        pytest.skip("this CPU has no integer path")
    one = logprobs(max_num_seqs=1)
    with kernel_settings(int_dots="on"):
        on = logprobs(max_num_seqs=2)
        q4_1_integer = "q4_1" in quant_cpu.int_dots_formats()
    several = logprobs(max_num_seqs=2)
    assert one == on
    if q4_1_integer:
        assert one != several
    else:
        assert one == several
