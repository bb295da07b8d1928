"""The small per-layer ops of a CPU step as one native call each (csrc/cpu_ops.c,
csrc/gated_delta_cpu.c).

At decode sizes a step's RMSNorms, rotary embedding, SiLU x up, K/V stores, greedy argmax,
grammar token masks, gated attention's output gate and a Gated DeltaNet layer's step cost
more in torch's per-op dispatch than in arithmetic; each of these replaces several torch ops.
They live in the library of pagecli_kernels/native.py and take float32 or bfloat16 CPU
tensors (argmax, the token mask, the output gate and the DeltaNet step: float32) whose last
dimension is contiguous. `available(x)` says whether a tensor can take them; callers keep
their torch code for everything else. Results equal the torch ops' up to the order of the
RMSNorm sum and the exp inside SiLU (tests/kernels/test_fused_cpu.py); the DeltaNet step
takes the recurrence token by token where torch's prefill takes it in chunks
(tests/kernels/test_gated_delta_cpu.py)."""

from __future__ import annotations

import ctypes

import torch

from pagecli_kernels import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_bound: dict = {}


def _lib() -> ctypes.CDLL:
    lib = native.library()
    if "lib" not in _bound:
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        lib.pagecli_store_kv.argtypes = [ptr, ptr, i64, i64, ptr, ptr, i64, i64, ptr]
        lib.pagecli_store_kv.argtypes += [i64, i64, i64, i64, i64]
        lib.pagecli_store_kv.restype = i32
        lib.pagecli_argmax_f32.argtypes = [ptr, i64, i64, i64, ptr, i32]
        lib.pagecli_argmax_f32.restype = None
        lib.pagecli_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32]
        lib.pagecli_rms_norm.argtypes += [i32, i32, i32]
        lib.pagecli_rms_norm.restype = None
        lib.pagecli_rotary.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64]
        lib.pagecli_rotary.argtypes += [i32, i32]
        lib.pagecli_rotary.restype = None
        lib.pagecli_act_mul.argtypes = [ptr, ptr, i64, i64, i64, i64, i32, i32, i32]
        lib.pagecli_act_mul.restype = None
        lib.pagecli_swiglu_oai.argtypes = [ptr, ptr, i64, i64, i64, i64, i32, f32, f32, i32]
        lib.pagecli_swiglu_oai.restype = None
        lib.pagecli_add_scaled.argtypes = [ptr, ptr, i64, i64, i64, i64, f32, i32, i32, i32]
        lib.pagecli_add_scaled.restype = None
        lib.pagecli_apply_token_bitmask_f32.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64]
        lib.pagecli_apply_token_bitmask_f32.restype = None
        lib.pagecli_gate_mul.argtypes = [ptr, ptr, i64, i64, i64, i64, i32]
        lib.pagecli_gate_mul.restype = None
        lib.pagecli_moe.argtypes = [ptr, ptr, i64, i64, ptr, i32]
        lib.pagecli_moe.restype = i32
        fn = lib.pagecli_gated_delta
        fn.argtypes = [ptr, i64, i64, ptr, i32, ptr, ptr, ptr, f32, ptr, ptr, i64, ptr, ptr]
        fn.argtypes += [i32, i32, i32, i32, i32, i32, ptr, i64, i32]
        fn.restype = i32
        _bound["lib"] = lib
    return _bound["lib"]


def available(x: torch.Tensor) -> bool:
    """Whether the fused ops take `x`: a float32 or bfloat16 CPU tensor, native kernels on."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and native.enabled()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Copy key/value `[T, Hk, D]` rows into their slots (slot < 0 skipped). Returns False,
    doing nothing, when the layouts do not allow row copies (the caller falls back)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    contiguous_rows = all(
        t.stride(-1) == 1 and t.stride(-2) == head_dim for t in (key, value, k_cache, v_cache)
    )
    if not (
        contiguous_rows
        and k_cache.stride() == v_cache.stride()
        and key.dtype == k_cache.dtype
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and native.enabled()
        and k_cache.device.type == "cpu"
    ):
        return False
    num_blocks, block_size = k_cache.shape[:2]
    status = _lib().pagecli_store_kv(
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.stride(0),
        k_cache.stride(1),
        slot_mapping.data_ptr(),
        num_tokens,
        row,
        key.element_size(),
        block_size,
        num_blocks * block_size,
    )
    if status != 0:
        raise ValueError(
            f"slot_mapping has a slot past the cache's {num_blocks * block_size} slots"
        )
    return True


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of float32 logits `[S, V]` (first maximum; a NaN wins) -> `[S]` int64."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, num_cols = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64)  # [S]
    _lib().pagecli_argmax_f32(
        logits.data_ptr(),
        num_rows,
        num_cols,
        logits.stride(0),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual_delta: torch.Tensor | None = None,
    weight_mode: int = 0,
) -> torch.Tensor:
    """RMSNorm of `x` as transformers computes it: rows `[N, W]`, or `[N, heads, W]` with each
    head normed on its own (heads back to back in a row: q/k norms on a projection's view).
    With `residual_delta` (rows only), first `x += residual_delta` in place (the decoder's
    residual add), then the norm of the sum. `weight_mode` 0: `weight` of x's dtype times the
    rounded product; 1: `weight` float32 times the float32 product, then rounded
    (layers/norm.py's styles). Returns a new contiguous tensor of x's shape."""
    num_rows = x.shape[0]
    heads, width = (1, x.shape[1]) if x.dim() == 2 else (x.shape[1], x.shape[2])
    out = torch.empty(x.shape, dtype=x.dtype)  # [N, W] or [N, heads, W]
    delta_ptr, delta_stride = None, 0
    if residual_delta is not None:
        delta_ptr, delta_stride = residual_delta.data_ptr(), residual_delta.stride(0)
    _lib().pagecli_rms_norm(
        x.data_ptr(),
        delta_ptr,
        weight.data_ptr(),
        out.data_ptr(),
        num_rows,
        heads,
        width,
        x.stride(0),
        delta_stride,
        out.stride(0),
        eps,
        _DTYPES[x.dtype],
        weight_mode,
        torch.get_num_threads(),
    )
    return out


def rotary_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False
) -> None:
    """Rotate q `[T, Hq, D]` and k `[T, Hk, D]` in place by cos/sin `[T, R]` (contiguous): the
    first R <= D values of each head (R < D: partial rotary). `pairs` (R == D): the heads come
    in llama.cpp's interleaved order and leave in transformers'."""
    num_tokens, num_q_heads, head_dim = q.shape
    _lib().pagecli_rotary(
        q.data_ptr(),
        k.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        num_tokens,
        num_q_heads,
        k.shape[1],
        head_dim,
        cos.shape[-1],
        q.stride(0),
        k.stride(0),
        _DTYPES[q.dtype],
        int(pairs),
    )


def rotary_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `rotary_` takes these views: heads back to back within each token's row."""
    head_dim = q.shape[-1]
    return (
        available(q)
        and head_dim <= 512
        and all(t.stride(-1) == 1 and t.stride(-2) == head_dim for t in (q, k))
    )


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # csrc/cpu_ops.c: pagecli_act_mul's act


def act_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for gate_up `[N, 2 * I]` (gate first) -> `[N, I]`; act "silu" or
    "gelu_tanh" (gelu with the tanh approximation, transformers' gelu_pytorch_tanh)."""
    num_rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype)  # [N, I]
    _lib().pagecli_act_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        num_rows,
        inter,
        gate_up.stride(0),
        out.stride(0),
        _DTYPES[gate_up.dtype],
        ACTIVATIONS[activation],
        torch.get_num_threads(),
    )
    return out


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU for gate_up `[N, 2 * I]` (gate first) -> `[N, I]`:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)."""
    num_rows, width = gate_up.shape
    out = torch.empty(num_rows, width // 2, dtype=gate_up.dtype)  # [N, I]
    _lib().pagecli_swiglu_oai(
        gate_up.data_ptr(), out.data_ptr(), num_rows, width // 2, gate_up.stride(0),
        out.stride(0), _DTYPES[gate_up.dtype], alpha, limit, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up `[N, 2 * I]` (gate first) -> `[N, I]`."""
    return act_mul(gate_up, "silu")


def add_scaled_(x: torch.Tensor, y: torch.Tensor, scale: float | None = None) -> None:
    """`x += y` in place, or `x += y * scale` with the product rounded to x's dtype first
    (torch's `x + y * scale`); x, y `[N, W]` with unit column stride."""
    num_rows, width = x.shape
    _lib().pagecli_add_scaled(
        x.data_ptr(),
        y.data_ptr(),
        num_rows,
        width,
        x.stride(0),
        y.stride(0),
        1.0 if scale is None else scale,
        int(scale is not None),
        _DTYPES[x.dtype],
        torch.get_num_threads(),
    )


def apply_token_bitmask_(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set logits[rows[r], t] = -inf, in place, for each token t that bit t % 32 of
    mask[r, t // 32] forbids (and every t past 32 * W). logits `[S, V]` float32 with unit
    column stride, mask `[R, W]` contiguous int32, rows `[R]` distinct int64 in [0, S)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(
            "logits must be a [S, V] float32 tensor with unit column stride, got "
            f"{logits.dtype} of shape {tuple(logits.shape)}, strides {tuple(logits.stride())}"
        )
    if mask.dim() != 2 or mask.dtype != torch.int32 or not mask.is_contiguous():
        raise ValueError(
            f"mask must be a contiguous [R, W] int32 tensor, got {mask.dtype} of shape "
            f"{tuple(mask.shape)}, strides {tuple(mask.stride())}"
        )
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.shape[0] != mask.shape[0]:
        raise ValueError(
            f"rows must be [R] int64 with R = {mask.shape[0]} (mask's rows), got {rows.dtype} "
            f"of shape {tuple(rows.shape)}"
        )
    if any(t.device.type != "cpu" for t in (logits, mask, rows)):
        raise ValueError("apply_token_bitmask_ takes CPU tensors here")
    if rows.shape[0] == 0:
        return
    rows = rows.contiguous()
    lowest, highest = (int(v) for v in torch.aminmax(rows))
    if lowest < 0 or highest >= logits.shape[0]:
        # the kernel writes where rows point: out of range would be out of bounds
        raise ValueError(f"rows must lie in [0, {logits.shape[0]}), got {lowest}..{highest}")
    _lib().pagecli_apply_token_bitmask_f32(
        logits.data_ptr(),
        logits.stride(0),
        logits.shape[1],
        mask.data_ptr(),
        mask.shape[1],
        rows.data_ptr(),
        rows.shape[0],
    )


def moe(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A sparse MoE MLP over float32 rows x `[T, H]` (unit stride) as the layer program's
    OP_MOE computes it (`table`: layers/moe.py's MOE_FIELDS table) -> `[T, H]` float32."""
    num_tokens, hidden = x.shape
    if x.stride(1) != 1 or x.stride(0) != hidden:
        x = x.contiguous()
    out = torch.empty(num_tokens, hidden, dtype=torch.float32)
    status = _lib().pagecli_moe(
        table.data_ptr(), x.data_ptr(), num_tokens, hidden, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise MemoryError("mixture of experts: out of memory for the scratch rows")
    if status:
        raise ValueError(f"mixture of experts: status {status}")
    return out


def gate_mul_takes(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether `gate_mul_` takes x and gate `[N, W]`: float32 CPU rows, unit stride."""
    return (
        available(x)
        and x.dtype == gate.dtype == torch.float32
        and x.dim() == gate.dim() == 2
        and x.shape == gate.shape
        and x.stride(-1) == gate.stride(-1) == 1
    )


def gate_mul_(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x *= sigmoid(gate) in place, float32 rows `[N, W]` (gated attention's output)."""
    num_rows, width = x.shape
    _lib().pagecli_gate_mul(
        x.data_ptr(),
        gate.data_ptr(),
        num_rows,
        width,
        x.stride(0),
        gate.stride(0),
        torch.get_num_threads(),
    )


def gated_delta(
    mixed: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    eps: float,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    shape: tuple[int, int, int, int],
    tiled: bool,
) -> torch.Tensor:
    """A Gated DeltaNet layer's step (csrc/gated_delta_cpu.c): the input projection's rows
    `mixed` [T, C + Hv dv + 2 Hv] (float32, unit stride) -> the gated norm's [T, Hv dv].
    `weights`: the conv kernel [C, K], A = -exp(A_log) and dt_bias [Hv], the norm's weight
    [dv], float32 contiguous; the sequences' states (float32 contiguous [slots, C, K - 1] and
    [slots, Hv, dk, dv]) are updated in place at `slots` [S] int64, sequence s the tokens from
    `starts` [S + 1] int32; `shape`: (Hk, Hv, dk, dv). ValueError for a slot outside the
    stores."""
    conv_weight, a, dt_bias, norm_weight = weights
    nk, nv, dk, dv = shape
    num_tokens = mixed.shape[0]
    out = torch.empty(num_tokens, nv * dv, dtype=torch.float32)  # [T, Hv dv]
    status = _lib().pagecli_gated_delta(
        mixed.data_ptr(),
        mixed.stride(0),
        num_tokens,
        conv_weight.data_ptr(),
        conv_weight.shape[1],
        a.data_ptr(),
        dt_bias.data_ptr(),
        norm_weight.data_ptr(),
        eps,
        conv_states.data_ptr(),
        ssm_states.data_ptr(),
        ssm_states.shape[0],
        slots.data_ptr(),
        starts.data_ptr(),
        slots.shape[0],
        nk,
        nv,
        dk,
        dv,
        int(tiled),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError("gated delta: out of memory for the scratch rows")
    if status:
        raise ValueError("gated delta: a state slot outside the stores")
    return out
