"""Huge-page host memory for streamed weights (pagecli_kernels/host_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagecli_kernels import host_memory
from pagecli_kernels.quant_formats import FORMATS, QuantWeight, concat_rows

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_on() -> bool:
    """Whether this kernel gives madvised anonymous memory huge pages ([madvise] or [always])."""
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def test_allocations_are_aligned_disjoint_and_hold_their_bytes():
    sizes = [1, 63, 64, 1000, 3 << 20, host_memory.CHUNK_BYTES + 5, 17]
    tensors = [host_memory.empty(n) for n in sizes]
    for n, t in zip(sizes, tensors, strict=True):
        assert t.dtype == torch.uint8 and t.numel() == n and t.is_contiguous()
        assert t.data_ptr() % host_memory.ALIGN == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
    for i, t in enumerate(tensors):
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(tensors))


def test_an_empty_request_takes_no_chunk(monkeypatch):
    monkeypatch.setattr(host_memory, "_chunk", {"buffer": None, "used": 0})
    assert host_memory.empty(0).numel() == 0
    assert host_memory._chunk["buffer"] is None
    assert host_memory.copy(torch.zeros(0, 576)).shape == (0, 576)


def test_copy_keeps_dtype_shape_and_values():
    x = torch.randn(37, 96)
    y = host_memory.copy(x[:, :64])  # a non-contiguous source
    assert y.dtype == x.dtype and y.shape == (37, 64) and y.is_contiguous()
    assert torch.equal(y, x[:, :64])
    assert y.data_ptr() % host_memory.ALIGN == 0


def test_without_the_os_support_it_is_plain_memory(monkeypatch):
    monkeypatch.setattr(host_memory, "_new_chunk", lambda nbytes: None)
    monkeypatch.setattr(host_memory, "_chunk", {"buffer": None, "used": 0})
    t = host_memory.empty(1000)
    assert t.numel() == 1000 and t.dtype == torch.uint8
    assert torch.equal(host_memory.copy(torch.arange(5)), torch.arange(5))


@pytest.mark.skipif(not _thp_on(), reason="this kernel gives no transparent huge pages")
def test_a_touched_chunk_is_on_huge_pages(monkeypatch):
    monkeypatch.setattr(host_memory, "_chunk", {"buffer": None, "used": 0})
    before = host_memory.huge_page_bytes()
    t = host_memory.empty(16 << 20)
    t.fill_(1)  # the first touch faults the pages in
    assert host_memory.huge_page_bytes() - before >= 4 << 20  # two of its eight 2 MiB pages


def test_concatenated_rows_land_in_host_memory(monkeypatch):
    taken = []
    original = host_memory.empty

    def spy(nbytes: int) -> torch.Tensor:
        out = original(nbytes)
        taken.append(out.data_ptr())
        return out

    monkeypatch.setattr(host_memory, "empty", spy)
    fmt = FORMATS["q8_0"]
    row_bytes = 64 // fmt.block_values * fmt.block_bytes
    parts = [
        QuantWeight(fmt, torch.randint(0, 255, (rows, row_bytes), dtype=torch.uint8), 64)
        for rows in (5, 3)
    ]
    joined = concat_rows(parts)
    assert joined.data.data_ptr() in taken
    assert torch.equal(joined.data, torch.cat([p.data for p in parts]))


def _huge_kib_of_mapping(address: int, field: str = "AnonHugePages") -> int:
    """AnonHugePages (or `field`, e.g. FilePmdMapped) in KiB of the mapping of this process
    that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not _thp_on(), reason="this kernel gives no transparent huge pages")
def test_the_default_models_streamed_weights_are_on_huge_pages():
    """The GGUF's blocks are read in place from its map, advised MADV_HUGEPAGE: once a step
    has read them, a kernel with large page-cache folios maps them with 2 MiB entries."""
    from pagecli import LLM, SamplingParams

    llm = LLM(num_kv_blocks=16)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
    model = llm.engine.runner.model
    weights = [model.layers[0].mlp.gate_up_proj.parts[0], model.embed_tokens.weight]
    weights.append(model.layers[-1].self_attn.o_proj.single_weight)
    for weight in weights:
        address = weight.data.data_ptr()
        huge = _huge_kib_of_mapping(address, "FilePmdMapped")
        if huge == 0 and _huge_kib_of_mapping(address, "Rss") > 0:
            pytest.skip("this kernel maps the file's page cache with small pages only")
        assert huge > 0, weight.format.name
