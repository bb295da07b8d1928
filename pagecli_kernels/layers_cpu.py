"""A Llama-family model's decoder layers in one native call (csrc/llama_layers_cpu.c).

The per-layer Python loop of pagecli/models/llama.py costs, at decode sizes, more in dispatch
than the layers cost in arithmetic: 30 layers x 11 kernel calls, each wrapped in checks and
tensor allocations. `DecoderLayers` binds every layer's weights and caches once (a table of
pointers) and runs the whole stack in C with the same kernels, arguments, order and thread
count, so its results are bit-for-bit the loop's (tests/kernels/test_layers_cpu.py).

It takes float32 activations and caches with projections of block-format (or float32 rows)
buffers, one to three parts each (stacked by rows, as `QuantLinear`'s parts), or bfloat16
activations and caches with bfloat16 or block-format projections (rounding where the loop's
bfloat16 tensors round), with or without a float32 bias, and no q/k norm (the model decides:
`pagecli.models.llama.LlamaForCausalLM.native_layers`).
`set_enabled(False)` turns it off for this process (tests and benchmarks compare both).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagecli_kernels import native, quant_cpu
from pagecli_kernels._checks import check_lengths_host
from pagecli_kernels.quant_formats import QuantWeight
from pagecli_kernels.shm_collective import CollectiveError, ShmCollective

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # csrc/llama_layers_cpu.c: dtype
MAX_PARTS = 3  # csrc/llama_layers_cpu.c: parts of one projection
LAYER_FIELDS = 4 + 4 * (2 + 3 * MAX_PARTS)  # F_* per layer: norms, projections, caches
GROUP_FIELDS = 8  # G_* per attention group
_ERRORS = {
    -1: "block_tables holds a block id outside the cache",
    -3: "slot_mapping has a slot past the cache",
    -4: "a weight format the kernels do not know",
    -5: "a projection's parts are not 1 to MAX_PARTS or their rows do not add up",
}
COLLECTIVE_ERROR = -6  # a tensor-parallel all-reduce timed out or was aborted

_state = {"enabled": True, "bound": False}
# seconds inside the projections and inside K/V stores + attention, summed over the calls
# made while timing is on (benchmarks/step_floor.py); None: not timed
_timings: dict = {"buffer": None}


def set_enabled(enabled: bool) -> None:
    """Turn the one-call decoder layers on or off for this process."""
    _state["enabled"] = enabled


def enabled() -> bool:
    """Whether the one-call layers are on and the native library is there."""
    return _state["enabled"] and native.enabled() and _library() is not None


def set_timing(on: bool) -> None:
    """Start (from zero) or stop summing the time spent inside the kernels of each call."""
    _timings["buffer"] = torch.zeros(2, dtype=torch.float64) if on else None


def kernel_seconds() -> dict[str, float]:
    """{"matmul": s, "attention": s} summed since `set_timing(True)` (zeros when off)."""
    buffer = _timings["buffer"]
    matmul, attention = (0.0, 0.0) if buffer is None else buffer.tolist()
    return {"matmul": matmul, "attention": attention}


def _library() -> ctypes.CDLL | None:
    lib = quant_cpu.library()  # binds the quantized kernels and torch's sgemm they use
    if lib is not None and not _state["bound"]:
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        lib.pagecli_llama_layers.argtypes = [ptr, i32, ptr, i64, i64, i32, i32, i32, i64, f32]
        lib.pagecli_llama_layers.argtypes += [ptr, ptr, ptr, i64, i32, i64, i64, i64, ptr, i32]
        lib.pagecli_llama_layers.argtypes += [f32, i32, i32, ptr, f32, ptr, i32, i32, ptr, ptr]
        lib.pagecli_llama_layers.restype = i32
        _state["bound"] = True
    return lib


Projection = QuantWeight | tuple[QuantWeight, ...]


def _parts(projection: Projection) -> tuple[QuantWeight, ...]:
    return projection if isinstance(projection, tuple) else (projection,)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors as the C loop reads them (norms in the activations' dtype,
    packed blocks)."""

    input_norm: torch.Tensor  # [H] float32 or bfloat16, as the caches
    post_norm: torch.Tensor  # [H]
    # each projection one buffer, or up to MAX_PARTS of them stacked by rows (their formats
    # may differ: Q4_K_M files keep some v projections in Q6_K)
    qkv: Projection  # [Q + 2 KV, H]
    o: Projection  # [H, Q]
    gate_up: Projection  # [2 I, H]
    down: Projection  # [H, I]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D] float32 or bfloat16
    v_cache: torch.Tensor
    # float32 biases of qkv, o, gate_up, down (None: no bias)
    biases: tuple[torch.Tensor | None, ...] = (None, None, None, None)


@dataclass(frozen=True)
class AttentionGroup:
    """A run of the step's tokens attended in one kernel call (the decodes, or the prefill
    chunks): `query_start_loc` counts from 0 within the group."""

    token_start: int
    num_tokens: int
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor | None  # [S + 1] int32; None: one token per sequence


class DecoderLayers:
    """Every decoder layer of one model, bound once; `__call__` runs them over a step."""

    def __init__(
        self,
        layers: list[LayerWeights],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        eps: float,
        scale: float,
        final_norm: torch.Tensor | None = None,
        final_eps: float = 0.0,
        qk_pairs: bool = False,
    ) -> None:
        """`final_norm` ([H] in the caches' dtype, with its `final_eps`): the model's last
        RMSNorm, which each call then also computes into the tensor it returns. The caches'
        dtype, float32 or bfloat16, is the activations' (`dtype`). `qk_pairs`: the q/k
        projections' rows are in llama.cpp's order (`LlamaAttention.qk_pairs`)."""
        lib = _library()
        if lib is None:
            raise RuntimeError(f"native kernels unavailable: {native.unavailable_reason()}")
        self._fn = lib.pagecli_llama_layers
        self.num_layers = len(layers)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.intermediate_size, self.eps, self.scale = intermediate_size, eps, scale
        first = layers[0].k_cache
        self._cache = first  # shape and strides, the same in every layer (checked)
        self.dtype = dtype = first.dtype
        self.hidden_size = hidden = layers[0].input_norm.shape[0]
        q, kv, inter = num_heads * head_dim, num_kv_heads * head_dim, intermediate_size
        shapes = ((q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter))
        rows = []
        for layer in layers:  # the C loop trusts these: check every size it reads by
            for cache in (layer.k_cache, layer.v_cache):
                if cache.shape != first.shape or cache.stride() != first.stride():
                    raise ValueError("every layer's K/V cache must have one shape and strides")
            if (
                dtype not in _DTYPES
                or tuple(first.shape[2:]) != (num_kv_heads, head_dim)
                or first.stride(-1) != 1
                or first.stride(-2) != head_dim
            ):
                raise ValueError(
                    f"the caches must be float32 or bfloat16 [*, *, {num_kv_heads}, {head_dim}]"
                )
            for norm in (layer.input_norm, layer.post_norm):
                if norm.shape != (hidden,) or norm.dtype != dtype or norm.stride(0) != 1:
                    raise ValueError(f"a norm weight must be {dtype} [{hidden}]")
            projections = [_parts(p) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            for parts, (rows_out, cols) in zip(projections, shapes, strict=True):
                if (
                    not 1 <= len(parts) <= MAX_PARTS
                    or any(part.cols != cols for part in parts)
                    or sum(part.rows for part in parts) != rows_out
                ):
                    raise ValueError(
                        f"projection shapes must be {shapes}, in 1 to {MAX_PARTS} parts"
                    )
            row = [layer.input_norm.data_ptr(), layer.post_norm.data_ptr()]
            for parts, bias, (rows_out, _) in zip(projections, layer.biases, shapes, strict=True):
                if bias is not None and (
                    bias.dtype != torch.float32
                    or not bias.is_contiguous()
                    or bias.shape != (rows_out,)
                ):
                    raise ValueError(f"a bias must be float32 [{rows_out}], contiguous")
                row += [0 if bias is None else bias.data_ptr(), len(parts)]
                for part in parts:
                    row += [part.format.ggml_type, part.data.data_ptr(), part.rows]
                row += [0, 0, 0] * (MAX_PARTS - len(parts))
            rows.append(row + [layer.k_cache.data_ptr(), layer.v_cache.data_ptr()])
        if final_norm is not None and (
            final_norm.shape != (hidden,) or final_norm.dtype != dtype or final_norm.stride(0) != 1
        ):
            raise ValueError(f"the final norm weight must be {dtype} [{hidden}]")
        self._final = (final_norm, float(final_eps))
        self.qk_pairs = bool(qk_pairs)
        self._table = torch.tensor(rows, dtype=torch.int64)  # [L, LAYER_FIELDS]
        if self._table.shape[1] != LAYER_FIELDS:  # the layout csrc/llama_layers_cpu.c reads
            raise RuntimeError(f"layer table of {self._table.shape[1]} fields, not {LAYER_FIELDS}")
        self._keep = layers  # the table points into these tensors

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        groups: list[AttentionGroup],
        collective: ShmCollective | None = None,
    ) -> torch.Tensor | None:
        """Run every layer over `hidden` [T, H] (the caches' dtype, contiguous) in place;
        cos/sin [T, D] of that dtype, contiguous; slot_mapping [T] int64. Checks the step's
        lengths once. Returns the final norm of the result ([T, H]) when bound with
        `final_norm`, else None. `collective`: a tensor-parallel rank's shared-memory
        all-reduce (float32 steps whose [T, H] fit its slot), which sums o_proj's and down's
        outputs over the ranks."""
        num_tokens, hidden_size = hidden.shape
        rope_shape = (num_tokens, self.head_dim)
        if (
            hidden_size != self.hidden_size
            or hidden.dtype != self.dtype
            or not hidden.is_contiguous()
            or any(t.shape != rope_shape or t.dtype != self.dtype for t in (cos, sin))
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError(
                f"hidden must be {self.dtype} [T, {self.hidden_size}] and cos/sin [T, "
                f"{self.head_dim}], contiguous"
            )
        cache = self._cache
        num_blocks, block_size = cache.shape[:2]
        threads = torch.get_num_threads()
        slot_mapping = slot_mapping.contiguous()
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
            raise ValueError(f"slot_mapping must be int64 [{num_tokens}]")
        rows, keep = [], []
        for g in groups:
            tables = (
                g.block_tables if g.block_tables.stride(1) == 1 else g.block_tables.contiguous()
            )
            seq_lens = g.seq_lens.contiguous()
            if tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
                raise ValueError("block_tables and seq_lens must be int32")
            num_seqs = seq_lens.shape[0]
            if tables.shape[0] != num_seqs:
                raise ValueError(
                    f"block_tables has {tables.shape[0]} rows for {num_seqs} sequences"
                )
            starts = g.query_start_loc
            if starts is None:
                if g.num_tokens != num_seqs:
                    raise ValueError(f"{g.num_tokens} decode tokens for {num_seqs} sequences")
                starts = torch.arange(num_seqs + 1, dtype=torch.int32)
            elif starts.dtype != torch.int32 or starts.shape != (num_seqs + 1,):
                raise ValueError(f"query_start_loc must be int32 [{num_seqs + 1}]")
            starts = starts.contiguous()
            part = hidden[g.token_start : g.token_start + g.num_tokens]
            lens, _ = check_lengths_host(part, tables, seq_lens, block_size, starts)
            split = native.choose_split_tokens(num_seqs * self.num_kv_heads, max(lens), threads)
            rows.append(
                [g.token_start, g.num_tokens, num_seqs, tables.data_ptr(), tables.stride(0)]
                + [seq_lens.data_ptr(), starts.data_ptr(), split]
            )
            keep += [tables, seq_lens, starts]
        table = torch.tensor(rows, dtype=torch.int64)  # [G, GROUP_FIELDS]
        tp = None if collective is None else collective.layer_fields()  # [TP_FIELDS]
        final_norm, final_eps = self._final
        normed = None if final_norm is None else torch.empty_like(hidden)  # [T, H]
        status = self._fn(
            self._table.data_ptr(),
            self.num_layers,
            hidden.data_ptr(),
            num_tokens,
            hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.eps,
            cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(),
            num_blocks,
            block_size,
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            table.data_ptr(),
            len(rows),
            self.scale,
            native.ISAS.index(native.isa()),
            threads,
            None if final_norm is None else final_norm.data_ptr(),
            final_eps,
            None if normed is None else normed.data_ptr(),
            _DTYPES[self.dtype],
            int(self.qk_pairs),
            None if _timings["buffer"] is None else _timings["buffer"].data_ptr(),
            None if tp is None else tp.data_ptr(),
        )
        if tp is not None:
            collective.after_layers(tp)
        if status == COLLECTIVE_ERROR:
            raise CollectiveError("a tensor-parallel collective timed out or was aborted")
        if status == -2:
            raise MemoryError("decoder layers: out of memory for the work buffers")
        if status:
            raise ValueError(f"decoder layers: {_ERRORS.get(status, f'status {status}')}")
        return normed
