"""The token-bitmask op (structured outputs) in each implementation against the reference, and
the reference against masks built token by token.

Comparisons are bit for bit over the whole logits buffer, padding columns and unlisted rows
included. The C kernel's AVX-512 / AVX2 / portable clones are chosen by the loader (GCC's
target_clones), which nothing in the repo can force; this CPU's widest one runs here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagecli_kernels import fused_cpu, native, ops, reference
from pagecli_kernels.settings import kernel_settings

VOCABS = [1, 31, 32, 33, 1000, 49152]
NUM_ROWS = [1, 3, 64]
DEVICE = os.environ.get("PAGECLI_KERNEL_TEST_DEVICE", "cpu")
NEG_INF = float("-inf")


def _words(allowed: list[bool]) -> list[int]:
    """llguidance's words for an allowed set, built one token at a time, as signed int32."""
    words = [0] * ((len(allowed) + 31) // 32)
    for t, ok in enumerate(allowed):
        if ok:
            words[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def _random_mask(num_rows: int, mask_words: int, gen: torch.Generator) -> torch.Tensor:
    """Random words, six in ten replaced by all ones, all zeros or single bits (bit 31, the
    word's sign, among them); with five rows or more, a row all ones and a row all zeros."""
    mask = torch.randint(-(2**31), 2**31, (num_rows, mask_words), generator=gen, dtype=torch.int32)
    special = torch.tensor([-1, 0, 1, 1 << 7, -(2**31), 2**31 - 1], dtype=torch.int32)
    kind = (torch.arange(num_rows)[:, None] * 7 + torch.arange(mask_words)) % 10  # [R, W]
    is_special = kind < len(special)
    mask[is_special] = special[kind[is_special]]
    if num_rows >= 5:
        mask[3], mask[4] = -1, 0  # a free-text row, a row that allows nothing
    return mask  # [R, W]


def _case(vocab: int, num_rows: int, seed: int, *, pad: int = 0, mask_words: int | None = None):
    """logits [S, V] as a view of a [S, V + pad] buffer (S = R + 3: three rows unlisted), a
    random mask and rows in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    num_logit_rows = num_rows + 3
    buffer = torch.randn(num_logit_rows, vocab + pad, generator=gen)  # [S, V + pad]
    if mask_words is None:
        mask_words = (vocab + 31) // 32
    mask = _random_mask(num_rows, mask_words, gen)  # [R, W]
    rows = torch.randperm(num_logit_rows, generator=gen)[:num_rows]  # [R] int64, any order
    return buffer, mask, rows


def _expected(buffer: torch.Tensor, vocab: int, mask: torch.Tensor, rows: torch.Tensor):
    out = buffer.clone()
    out[:, :vocab] = reference.apply_token_bitmask(buffer[:, :vocab], mask, rows)
    return out


def _assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    bits = torch.int32 if actual.dtype == torch.float32 else torch.int16
    diff = (actual.view(bits) != expected.view(bits)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} values differ, first at {diff[:5].tolist()}"


# the reference itself, against masks built one token at a time


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_reference_forbids_exactly_the_unset_bits(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen)
    allowed = [[bool(b) for b in torch.randint(0, 2, (vocab,), generator=gen)] for _ in range(2)]
    allowed[1][vocab - 1] = True  # the last token (bit 31 of a full word when vocab is 32)
    mask = torch.tensor([_words(a) for a in allowed], dtype=torch.int32)
    rows = torch.tensor([3, 1])
    out = reference.apply_token_bitmask(logits, mask, rows)
    for row, row_allowed in zip(rows.tolist(), allowed, strict=True):
        for t, ok in enumerate(row_allowed):
            assert out[row, t].item() == (logits[row, t].item() if ok else NEG_INF), (row, t)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])


def test_reference_forbids_tokens_past_a_narrow_mask_and_ignores_extra_bits():
    logits = torch.randn(1, 70)
    narrow = reference.apply_token_bitmask(
        logits, torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([0])
    )
    assert torch.equal(narrow[0, :32], logits[0, :32])
    assert torch.isneginf(narrow[0, 32:]).all()
    wide = reference.apply_token_bitmask(
        logits[:, :5], torch.full((1, 3), -1, dtype=torch.int32), torch.tensor([0])
    )
    assert torch.equal(wide, logits[:, :5])


# the C kernel


@pytest.fixture
def built():
    if native.library() is None:
        pytest.fail(f"the native CPU kernel did not build: {native.unavailable_reason()}")


@pytest.mark.parametrize("num_rows", NUM_ROWS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_c_kernel_matches_reference(built, vocab, num_rows):
    buffer, mask, rows = _case(vocab, num_rows, seed=vocab + num_rows)
    expected = _expected(buffer, vocab, mask, rows)
    fused_cpu.apply_token_bitmask_(buffer, mask, rows)
    _assert_bitwise_equal(buffer, expected)


@pytest.mark.parametrize("vocab", [33, 1000, 49152])
def test_c_kernel_padded_rows_and_narrow_or_wide_masks(built, vocab):
    words = (vocab + 31) // 32
    for pad, mask_words in ((13, words), (7, words // 2), (1, words + 2), (0, 0)):
        buffer, mask, rows = _case(vocab, 5, seed=vocab + pad, pad=pad, mask_words=mask_words)
        expected = _expected(buffer, vocab, mask, rows)
        fused_cpu.apply_token_bitmask_(buffer[:, :vocab], mask, rows)
        _assert_bitwise_equal(buffer, expected)  # the padding columns too


def test_c_kernel_rejects_what_it_cannot_take(built):
    logits = torch.randn(3, 40)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows must lie in"):
        fused_cpu.apply_token_bitmask_(logits, mask, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="rows must lie in"):
        fused_cpu.apply_token_bitmask_(logits, mask, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="mask must be"):
        fused_cpu.apply_token_bitmask_(
            logits, torch.zeros(2, 4, dtype=torch.int32)[:, ::2], torch.tensor([0, 1])
        )
    with pytest.raises(ValueError, match="logits must be"):
        fused_cpu.apply_token_bitmask_(logits.double(), mask, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rows must be"):
        fused_cpu.apply_token_bitmask_(logits, mask, torch.tensor([0, 1], dtype=torch.int32))
    before = logits.clone()
    fused_cpu.apply_token_bitmask_(logits, mask[:0], torch.tensor([], dtype=torch.int64))
    assert torch.equal(logits, before)


# the public op's CPU paths


@pytest.mark.parametrize("path", ["c", "torch", "reference"])
def test_op_cpu_paths_match_reference(built, path):
    buffer, mask, rows = _case(1000, 6, seed=7, pad=24, mask_words=20)  # 640 tokens covered
    mask = torch.cat([mask, mask], dim=1)[:, ::2]  # strided: the C path takes a copy
    expected = _expected(buffer, 1000, mask, rows)
    impl = "reference" if path == "reference" else "cpu"
    with kernel_settings(native=path != "torch"):
        ops.apply_token_bitmask_(buffer[:, :1000], mask, rows, impl=impl)
    _assert_bitwise_equal(buffer, expected)


def test_op_torch_path_in_bfloat16():
    buffer, mask, rows = _case(100, 3, seed=8, pad=4)
    buffer = buffer.to(torch.bfloat16)
    expected = _expected(buffer, 100, mask, rows)
    ops.apply_token_bitmask_(buffer[:, :100], mask, rows)
    _assert_bitwise_equal(buffer, expected)


def test_op_rejects_bad_arguments():
    logits = torch.randn(2, 40)
    with pytest.raises(ValueError, match="mask must be"):
        ops.apply_token_bitmask_(logits, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows must be"):
        ops.apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="impl must be"):
        ops.apply_token_bitmask_(
            logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0]), impl="cuda"
        )


# the Triton kernel, interpreted on CPU tensors (or compiled, on a CUDA test device)

needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and DEVICE != "cuda",
    reason="needs Triton's interpreter or a CUDA device",
)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("vocab", "num_rows", "pad", "narrow"),
    [(1, 1, 0, False), (33, 3, 5, False), (1000, 2, 24, True), (2100, 3, 3, False)],
)
def test_triton_kernel_matches_reference(vocab, num_rows, pad, narrow, dtype):
    pytest.importorskip("triton")
    words = (vocab + 31) // 32
    mask_words = words // 2 if narrow else words
    buffer, mask, rows = _case(vocab, num_rows, seed=vocab, pad=pad, mask_words=mask_words)
    buffer = buffer.to(dtype)
    expected = _expected(buffer, vocab, mask, rows)
    buffer, mask, rows = buffer.to(DEVICE), mask.to(DEVICE), rows.to(DEVICE)
    ops.apply_token_bitmask_(buffer[:, :vocab], mask, rows, impl="triton")
    _assert_bitwise_equal(buffer.cpu(), expected)


def test_triton_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    script = Path(__file__).with_name("compile_kernels.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's warning
    result = subprocess.run(
        [sys.executable, str(script), "--kernel", "_apply_token_bitmask_kernel"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "3 variants for sm_90, 0 failed" in result.stdout
