"""A model's decoder layers as one native call: its layer program (csrc/layer_program_cpu.c).

The per-layer Python loop of pagecli/models/blocks.py costs, at decode sizes, more in
dispatch than the layers cost in arithmetic: 30 layers x a dozen kernel calls, each wrapped in
checks and tensor allocations. A model lists its layers' ops (pagecli_kernels/layer_ops.py);
`LayerProgram` checks every size, dtype and layout the C loop will read, binds the list once
(a table of ops and pointers) and runs the whole stack in C with the same kernels, arguments,
order and thread count as the loop, so its results are bit-for-bit the loop's
(tests/kernels/test_layers_cpu.py).

It takes float32 activations and caches with projections of block-format (or float32 rows)
buffers, one to three parts each (stacked by rows, as `QuantLinear`'s parts), or bfloat16
activations and caches with bfloat16 or block-format projections (rounding where the loop's
bfloat16 tensors round), with or without a float32 bias. The settings' `layers=False`
(pagecli_kernels/settings.py) turns it off for the process (tests and benchmarks compare both).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from pagecli_kernels import native, quant_cpu
from pagecli_kernels._checks import check_lengths_host
from pagecli_kernels.layer_ops import (
    BUFFERS,
    ActMul,
    Add,
    AllReduce,
    Attention,
    DeltaNet,
    GateMul,
    Linear,
    MoE,
    Norm,
    Op,
    Rotary,
    SplitHeads,
)
from pagecli_kernels.quant_formats import QuantWeight
from pagecli_kernels.shm_collective import CollectiveError, ShmCollective

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # csrc/layer_program_cpu.c: dtype
MAX_PARTS = 4  # csrc/layer_program_cpu.c: parts of one projection
OP_FIELDS = 16  # int64 fields of one op
PROJECTION_FIELDS = 2 + 3 * MAX_PARTS
GROUP_FIELDS = 8  # G_* per attention group
_OPCODES = {
    Norm: 1,
    Linear: 2,
    Rotary: 3,
    Attention: 4,
    ActMul: 5,
    Add: 6,
    AllReduce: 7,
    SplitHeads: 8,
    GateMul: 9,
    DeltaNet: 10,
    MoE: 11,
}
MOE_FIELDS = 14  # csrc/layer_program_cpu.c: MOE_* of an OP_MOE table
DELTA_FIELDS = 14  # csrc/layer_program_cpu.c: DN_* of an OP_DELTANET table
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
_ERRORS = {
    -1: "block_tables holds a block id outside the cache",
    -3: "slot_mapping has a slot past the cache",
    -4: "a weight format the kernels do not know",
    -5: "a projection's parts are not 1 to MAX_PARTS or their rows do not add up",
    -7: "an op the interpreter does not know, or a buffer out of range",
    -8: "a recurrent state slot outside the stores, or sequences that miss the step's tokens",
}
COLLECTIVE_ERROR = -6  # a tensor-parallel all-reduce timed out or was aborted

_state = {"enabled": True, "bound": False}
# seconds inside the projections and inside K/V stores + attention, summed over the calls
# made while timing is on (the settings' `timing`; benchmarks/step_floor.py); None: not timed
_timings: dict = {"buffer": None}


def enabled() -> bool:
    """Whether the one-call layers are on and the native library is there."""
    return _state["enabled"] and native.enabled() and _library() is not None


def timing() -> bool:
    """Whether each call sums the time spent inside its kernels (`kernel_seconds()`)."""
    return _timings["buffer"] is not None


def kernel_seconds() -> dict[str, float]:
    """{"matmul": s, "attention": s} summed since timing was turned on or
    `reset_kernel_seconds()` (zeros when off)."""
    buffer = _timings["buffer"]
    matmul, attention = (0.0, 0.0) if buffer is None else buffer.tolist()
    return {"matmul": matmul, "attention": attention}


def reset_kernel_seconds() -> None:
    """Start `kernel_seconds()` from zero again (while timing is on)."""
    if _timings["buffer"] is not None:
        _timings["buffer"].zero_()


def _configure(enabled: bool, timing: bool) -> None:
    """The settings' part (pagecli_kernels/settings.py): the one-call layers on or off, and
    their kernel timers on (from zero, where they were off) or off."""
    _state["enabled"] = enabled
    if timing != (_timings["buffer"] is not None):
        _timings["buffer"] = torch.zeros(2, dtype=torch.float64) if timing else None


def _library() -> ctypes.CDLL | None:
    lib = quant_cpu.library()  # binds the quantized kernels and torch's sgemm they use
    if lib is not None and not _state["bound"]:
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        fn = lib.pagecli_layer_program
        fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i32, ptr, i64, i32, i64, i32, i64, i64]
        fn.argtypes += [i64, ptr]
        fn.argtypes += [i32, i32, i32, ptr, f32, i32, ptr, i32, ptr, ptr, ptr, ptr, i32]
        fn.restype = i32
        _state["bound"] = True
    return lib


def float_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def projection_table(
    parts: tuple[QuantWeight, ...], bias: torch.Tensor | None, in_features: int, out_features: int
) -> torch.Tensor:
    """A projection as the C loop reads it ([PROJECTION_FIELDS] int64: the bias, the part
    count, each part's format, data and rows); ValueError for parts it cannot take. The
    caller keeps `parts` and `bias` alive as long as the table."""
    if (
        not 1 <= len(parts) <= MAX_PARTS
        or not all(isinstance(p, QuantWeight) and p.data.device.type == "cpu" for p in parts)
        or any(p.cols != in_features for p in parts)
        or sum(p.rows for p in parts) != out_features
    ):
        raise ValueError(
            f"projection parts must be 1 to {MAX_PARTS} CPU block buffers of "
            f"{in_features} columns and {out_features} rows in all"
        )
    if bias is not None and (
        bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (out_features,)
    ):
        raise ValueError(f"a bias must be float32 [{out_features}], contiguous")
    row = [0 if bias is None else bias.data_ptr(), len(parts)]
    for part in parts:
        row += [part.format.ggml_type, part.data.data_ptr(), part.rows]
    row += [0, 0, 0] * (MAX_PARTS - len(parts))
    return torch.tensor(row, dtype=torch.int64)  # [PROJECTION_FIELDS]


@dataclass(frozen=True)
class AttentionGroup:
    """A run of the step's tokens attended in one kernel call (the decodes, or the prefill
    chunks): `query_start_loc` counts from 0 within the group."""

    token_start: int
    num_tokens: int
    block_tables: torch.Tensor  # [G, S, max_blocks] int32, per KV cache group (or [S, ...])
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor | None  # [S + 1] int32; None: one token per sequence


class LayerProgram:
    """A model's decoder layers as ops, bound once; `__call__` runs them over a step."""

    def __init__(
        self,
        ops: list[Op],
        widths: dict[str, int],
        rotary_dims: list[int],
        dtype: torch.dtype,
        *,
        final_norm: torch.Tensor | None = None,
        final_eps: float = 0.0,
        final_mode: int = 0,
    ) -> None:
        """`widths`: each buffer's values per token (layer_ops.BUFFERS); `rotary_dims`: the
        width of each rope table the Rotary ops name; `dtype`: the activations' and caches'
        (float32 or bfloat16). `final_norm` ([H], with its eps and weight mode): the model's
        last RMSNorm, which each call then also computes into the tensor it returns.
        ValueError for anything the C loop would read wrong."""
        lib = _library()
        if lib is None:
            raise RuntimeError(f"native kernels unavailable: {native.unavailable_reason()}")
        if dtype not in _DTYPES:
            raise ValueError(f"activations must be float32 or bfloat16, not {dtype}")
        if set(widths) != set(BUFFERS) or any(w < 1 for w in widths.values()):
            raise ValueError(f"widths must give every buffer of {BUFFERS} a positive size")
        self._fn = lib.pagecli_layer_program
        self.dtype = dtype
        self.widths = dict(widths)
        # each buffer's width in BUFFERS order, made once: every call passes its pointer
        self._widths = torch.tensor([widths[b] for b in BUFFERS], dtype=torch.int64)
        self.hidden_size = widths["hidden"]
        self.rotary_dims = list(rotary_dims)
        self.ops = list(ops)
        self._keep: list = []  # tensors the tables point into
        self._projections: list[torch.Tensor] = []  # each Linear's [PROJECTION_FIELDS]
        self._cache: torch.Tensor | None = None  # shape and strides, one for every layer
        self._num_kv_heads = 1
        self._has_states = False  # a DeltaNet op: each step names its sequences' state slots
        rows = [self._row(op) for op in ops]
        self._table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), OP_FIELDS)
        if self._cache is None:
            raise ValueError("a layer program needs at least one attention op")
        if final_norm is not None:
            wanted = dtype if final_mode == 0 else torch.float32
            if (
                final_norm.shape != (self.hidden_size,)
                or final_norm.dtype != wanted
                or final_norm.stride(0) != 1
            ):
                raise ValueError(f"the final norm weight must be {wanted} [{self.hidden_size}]")
        self._final = (final_norm, float(final_eps), int(final_mode))

    # ---- binding -------------------------------------------------------------------------

    def _buffer(self, name: str | None, col: int = 0, count: int = 0) -> int:
        if name not in BUFFERS:
            raise ValueError(f"unknown buffer {name!r}")
        if col < 0 or count < 0 or col + count > self.widths[name]:
            raise ValueError(
                f"columns {col}..{col + count} are outside buffer {name!r} of {self.widths[name]}"
            )
        return BUFFERS.index(name)

    def _row(self, op: Op) -> list[int]:
        fields = [_OPCODES[type(op)]]
        if isinstance(op, Norm):
            span = op.heads * op.width
            wanted = self.dtype if op.weight_mode == 0 else torch.float32
            if (
                op.weight.shape != (op.width,)
                or op.weight.dtype != wanted
                or op.weight.stride(0) != 1
                or op.weight_mode not in (0, 1)
                or op.heads < 1
            ):
                raise ValueError(f"a norm weight must be {wanted} [{op.width}]")
            if op.delta is not None and (op.heads != 1 or self.widths[op.delta] != span):
                raise ValueError("a norm's residual delta must be whole rows of its width")
            fields += [
                self._buffer(op.src, op.src_col, span),
                op.src_col,
                int(op.delta is not None),
                0 if op.delta is None else self._buffer(op.delta, 0, span),
                self._buffer(op.dst, op.dst_col, span),
                op.dst_col,
                op.heads,
                op.width,
                op.weight.data_ptr(),
                float_bits(op.eps),
                op.weight_mode,
            ]
            self._keep.append(op.weight)
        elif isinstance(op, Linear):
            if self.widths[op.src] != op.in_features or self.widths[op.dst] != op.out_features:
                raise ValueError(
                    f"a projection of [{op.out_features}, {op.in_features}] must read and "
                    f"write whole rows ({op.src} has {self.widths[op.src]}, {op.dst} has "
                    f"{self.widths[op.dst]})"
                )
            if op.src == op.dst:
                raise ValueError("a projection cannot write the buffer it reads")
            table = self._projection(op)
            fields += [
                self._buffer(op.src, 0, op.in_features),
                self._buffer(op.dst, 0, op.out_features),
                op.in_features,
                op.out_features,
                table.data_ptr(),
            ]
        elif isinstance(op, Rotary):
            if not 0 <= op.rope < len(self.rotary_dims):
                raise ValueError(f"rope table {op.rope} of {len(self.rotary_dims)}")
            rd = self.rotary_dims[op.rope]
            if rd > op.head_dim or rd % 2 or rd > 512 or (op.pairs and rd != op.head_dim):
                raise ValueError(f"a rotary width of {rd} for heads of {op.head_dim}")
            fields += [
                self._buffer(op.buf, op.q_col, op.q_heads * op.head_dim),
                op.q_col,
                op.k_col,
                op.q_heads,
                op.k_heads,
                op.head_dim,
                rd,
                int(op.pairs),
                op.rope,
            ]
            self._buffer(op.buf, op.k_col, op.k_heads * op.head_dim)
        elif isinstance(op, Attention):
            fields += self._attention(op)
        elif isinstance(op, ActMul):
            if op.activation not in _ACTIVATIONS:
                raise ValueError(f"unknown activation {op.activation!r}")
            fields += [
                self._buffer(op.src, 0, 2 * op.inter),
                self._buffer(op.dst, 0, op.inter),
                op.inter,
                _ACTIVATIONS[op.activation],
            ]
        elif isinstance(op, Add):
            width = self.widths[op.dst]
            if self.widths[op.src] != width:
                raise ValueError(f"cannot add {op.src!r} to {op.dst!r}: widths differ")
            fields += [
                self._buffer(op.dst, 0, width),
                self._buffer(op.src, 0, width),
                width,
                int(op.scale is not None),
                float_bits(0.0 if op.scale is None else op.scale),
            ]
        elif isinstance(op, AllReduce):
            fields += [self._buffer(op.buf), self.widths[op.buf]]
        elif isinstance(op, SplitHeads):
            if op.heads < 1 or op.width < 1:
                raise ValueError(f"{op.heads} heads of {op.width} values")
            fields += [
                self._buffer(op.buf, op.col, 2 * op.heads * op.width),
                op.col,
                op.heads,
                op.width,
            ]
        elif isinstance(op, GateMul):
            if self.dtype != torch.float32:
                raise ValueError("an output gate takes float32 activations")
            fields += [
                self._buffer(op.dst, 0, op.width),
                self._buffer(op.src, op.src_col, op.width),
                op.src_col,
                op.width,
            ]
        elif isinstance(op, DeltaNet):
            fields += self._deltanet(op)
        elif isinstance(op, MoE):
            if self.dtype != torch.float32:
                raise ValueError("a mixture-of-experts layer takes float32 activations")
            hidden = self.hidden_size
            if self.widths[op.src] != hidden or self.widths[op.dst] != hidden or op.src == op.dst:
                raise ValueError("a mixture-of-experts layer reads and writes whole hidden rows")
            if op.table.dtype != torch.int64 or op.table.shape != (MOE_FIELDS,):
                raise ValueError(f"a mixture-of-experts table must be int64 [{MOE_FIELDS}]")
            self._keep += [op.table, op.keep]
            fields += [self._buffer(op.src), self._buffer(op.dst), op.table.data_ptr()]
        else:
            raise ValueError(f"not a layer op: {op!r}")
        return fields + [0] * (OP_FIELDS - len(fields))

    def _projection(self, op: Linear) -> torch.Tensor:
        table = projection_table(op.parts, op.bias, op.in_features, op.out_features)
        self._projections.append(table)
        self._keep += [*op.parts, op.bias]
        return table

    def _deltanet(self, op: DeltaNet) -> list[int]:
        if self.dtype != torch.float32:
            raise ValueError("a Gated DeltaNet layer takes float32 activations")
        nk, nv, dk, dv = op.num_k_heads, op.num_v_heads, op.k_head_dim, op.v_head_dim
        channels, values = 2 * nk * dk + nv * dv, nv * dv
        kernel = op.conv_weight.shape[-1] if op.conv_weight.dim() == 2 else 0
        slots = op.ssm_states.shape[0]
        shapes = (
            (op.conv_weight, (channels, kernel)),
            (op.a, (nv,)),
            (op.dt_bias, (nv,)),
            (op.norm_weight, (dv,)),
            (op.conv_states, (slots, channels, kernel - 1)),
            (op.ssm_states, (slots, nv, dk, dv)),
        )
        if (
            min(nk, nv, dk, dv) < 1
            or nv % nk
            or not 2 <= kernel <= 17
            or any(
                t.shape != shape
                or t.dtype != torch.float32
                or not t.is_contiguous()
                or t.device.type != "cpu"
                for t, shape in shapes
            )
        ):
            raise ValueError(
                f"a Gated DeltaNet layer of {nk} key and {nv} value heads ({dk}, {dv}) takes "
                "float32 contiguous CPU weights and state stores of its shape"
            )
        if self.widths[op.src] != channels + values + 2 * nv or self.widths[op.dst] != values:
            raise ValueError("a Gated DeltaNet layer reads and writes whole rows")
        table = torch.tensor(
            [t.data_ptr() for t, _ in shapes]
            + [slots, kernel, nk, nv, dk, dv, int(op.tiled), float_bits(op.eps)],
            dtype=torch.int64,
        )  # [DELTA_FIELDS]
        self._projections.append(table)
        self._keep += [t for t, _ in shapes]
        self._has_states = True
        return [self._buffer(op.src), self._buffer(op.dst), table.data_ptr()]

    def _attention(self, op: Attention) -> list[int]:
        d = op.head_dim
        q, kv = op.num_heads * d, op.num_kv_heads * d
        for cache in (op.k_cache, op.v_cache):
            if self._cache is None:
                self._cache = cache
            first = self._cache
            if (
                cache.shape != first.shape
                or cache.stride() != first.stride()
                or cache.dtype != self.dtype
                or tuple(cache.shape[2:]) != (op.num_kv_heads, d)
                or cache.stride(-1) != 1
                or cache.stride(-2) != d
                or cache.device.type != "cpu"
            ):
                raise ValueError(
                    f"every layer's K/V cache must be {self.dtype} [*, *, {op.num_kv_heads}, "
                    f"{d}] with one shape and strides"
                )
        if op.num_kv_heads < 1 or op.num_heads % op.num_kv_heads or d > 512:
            raise ValueError(f"{op.num_heads} query heads over {op.num_kv_heads} KV heads of {d}")
        if self.widths[op.dst] != q or self.widths["attn"] < q:
            raise ValueError(f"attention writes whole rows of {q} values")
        if op.window is not None and op.window < 1:
            raise ValueError(f"a window of {op.window} tokens")
        if op.kv_group < 0:
            raise ValueError(f"KV cache group {op.kv_group}")
        sinks = op.sinks
        if sinks is not None and (
            sinks.dtype != torch.float32
            or sinks.shape != (op.num_heads,)
            or not sinks.is_contiguous()
        ):
            raise ValueError(f"sinks must be float32 [{op.num_heads}], contiguous")
        self._buffer(op.src, op.k_col, kv)
        self._buffer(op.src, op.v_col, kv)
        self._num_kv_heads = op.num_kv_heads
        self._keep += [op.k_cache, op.v_cache, sinks]
        return [
            self._buffer(op.src, op.q_col, q),
            op.q_col,
            op.k_col,
            op.v_col,
            self._buffer(op.dst, 0, q),
            op.k_cache.data_ptr(),
            op.v_cache.data_ptr(),
            op.num_heads,
            op.num_kv_heads,
            d,
            op.window or 0,
            0 if sinks is None else sinks.data_ptr(),
            float_bits(op.scale),
            op.kv_group,
        ]

    # ---- running -------------------------------------------------------------------------

    def __call__(
        self,
        hidden: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        slot_mapping: torch.Tensor,
        groups: list[AttentionGroup],
        collective: ShmCollective | None = None,
        state_slots: torch.Tensor | None = None,
        state_starts: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run every op over `hidden` [T, H] (the program's dtype, contiguous) in place;
        `ropes`: (cos, sin) [T, R] of that dtype, contiguous, per rope table; slot_mapping
        [G, T] int64 per KV cache group (or [T]: one group). Checks the step's lengths once.
        Returns the final norm of the result ([T, H]) when bound with `final_norm`, else None.
        `collective`: a tensor-parallel rank's shared-memory all-reduce (float32 steps whose
        [T, H] fit its slot), which the AllReduce ops sum through. `state_slots` [S] int64
        and `state_starts` [S + 1] int32: the step's sequences' recurrent state slots and
        first tokens, for programs with DeltaNet ops."""
        num_tokens, hidden_size = hidden.shape
        if (
            hidden_size != self.hidden_size
            or hidden.dtype != self.dtype
            or not hidden.is_contiguous()
        ):
            raise ValueError(f"hidden must be {self.dtype} [T, {self.hidden_size}], contiguous")
        if len(ropes) != len(self.rotary_dims):
            raise ValueError(f"{len(ropes)} rope tables for {len(self.rotary_dims)}")
        rope_rows = []
        for (cos, sin), rd in zip(ropes, self.rotary_dims):
            if any(
                t.shape != (num_tokens, rd) or t.dtype != self.dtype or not t.is_contiguous()
                for t in (cos, sin)
            ):
                raise ValueError(f"cos/sin must be {self.dtype} [T, {rd}], contiguous")
            rope_rows.append([cos.data_ptr(), sin.data_ptr(), rd])
        ropes_table = torch.tensor(rope_rows or [[0, 0, 0]], dtype=torch.int64)
        cache = self._cache
        num_blocks, block_size = cache.shape[:2]
        threads = torch.get_num_threads()
        if slot_mapping.dim() == 1:
            slot_mapping = slot_mapping.unsqueeze(0)
        if slot_mapping.stride(-1) != 1:
            slot_mapping = slot_mapping.contiguous()
        kv_groups = slot_mapping.shape[0]
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (kv_groups, num_tokens):
            raise ValueError(f"slot_mapping must be int64 [G, {num_tokens}]")
        rows, keep = [], []
        for g in groups:
            tables = g.block_tables if g.block_tables.dim() == 3 else g.block_tables.unsqueeze(0)
            if tables.stride(2) != 1:
                tables = tables.contiguous()
            if tables.shape[0] != kv_groups:
                raise ValueError(f"block tables of {tables.shape[0]} groups for {kv_groups}")
            seq_lens = g.seq_lens.contiguous()
            if tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
                raise ValueError("block_tables and seq_lens must be int32")
            num_seqs = seq_lens.shape[0]
            if tables.shape[1] != num_seqs:
                raise ValueError(
                    f"block_tables has {tables.shape[1]} rows for {num_seqs} sequences"
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
            lens, _ = check_lengths_host(part, tables[0], seq_lens, block_size, starts)
            items = native.distinct_sequences(tables[0]) * self._num_kv_heads
            split = native.choose_split_tokens(items, max(lens), threads)
            rows.append(
                [g.token_start, g.num_tokens, num_seqs, tables.data_ptr(), tables.stride(1)]
                + [seq_lens.data_ptr(), starts.data_ptr(), split, tables.stride(0)]
            )
            keep += [tables, seq_lens, starts]
        table = torch.tensor(rows, dtype=torch.int64)  # [G, GROUP_FIELDS]
        num_state_seqs = 0
        if self._has_states:
            if state_slots is None or state_starts is None:
                raise ValueError("a program with recurrent layers needs the step's state slots")
            num_state_seqs = state_slots.shape[0]
            if (
                state_slots.dtype != torch.int64
                or state_starts.dtype != torch.int32
                or state_starts.shape != (num_state_seqs + 1,)
                or not state_slots.is_contiguous()
                or not state_starts.is_contiguous()
            ):
                raise ValueError("state_slots must be int64 [S], state_starts int32 [S + 1]")
        tp = None if collective is None else collective.layer_fields()  # [TP_FIELDS]
        final_norm, final_eps, final_mode = self._final
        normed = None if final_norm is None else torch.empty_like(hidden)  # [T, H]
        status = self._fn(
            self._table.data_ptr(),
            self._table.shape[0],
            hidden.data_ptr(),
            num_tokens,
            self._widths.data_ptr(),
            ropes_table.data_ptr(),
            len(rope_rows),
            slot_mapping.data_ptr(),
            slot_mapping.stride(0),
            kv_groups,
            num_blocks,
            block_size,
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            table.data_ptr(),
            len(rows),
            native.ISAS.index(native.isa()),
            threads,
            None if final_norm is None else final_norm.data_ptr(),
            final_eps,
            final_mode,
            None if normed is None else normed.data_ptr(),
            _DTYPES[self.dtype],
            None if _timings["buffer"] is None else _timings["buffer"].data_ptr(),
            None if tp is None else tp.data_ptr(),
            None if not num_state_seqs else state_slots.data_ptr(),
            None if not num_state_seqs else state_starts.data_ptr(),
            num_state_seqs,
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

    @property
    def num_ops(self) -> int:
        return self._table.shape[0]
