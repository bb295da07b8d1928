"""Gated DeltaNet: the linear-attention layer of Qwen3.5/3.6 and Qwen3-Next.

Per token, after one input projection (q, k, v, the output gate z, and the per-head a, b):

    q, k, v = silu(causal depthwise conv over the last `kernel` tokens of [q, k, v])
    q, k    = l2-normalized per head (q then scaled by 1/sqrt(d_k)); each of the Hk key heads
              serves Hv / Hk consecutive value heads
    beta    = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)        (per value head)
    S       = exp(g) * S                                  S: [d_k, d_v] per value head
    S       = S + k (beta * (v - S^T k))^T               the delta rule
    o       = S^T q,  out = out_proj(rms_norm(o) * w * silu(z))

A sequence carries no per-token cache: its state is the conv window (the last kernel - 1
inputs) and S, both in a state slot of its own (engine: one slot per running sequence, zeroed
when the sequence starts).

On the CPU with float32 activations, the whole step after the input projection is one native
call (csrc/gated_delta_cpu.c, also an op of the layer program): conv, norms, the recurrence
token by token for decodes and prefill chunks alike (two passes over a head's state per
token, which a prefill keeps in cache), and the gated norm. Elsewhere (CUDA, bfloat16, no C
compiler) torch runs the conv and the norms; the recurrence is the Triton kernel of
pagecli_kernels/gated_delta.py on CUDA (`impl`, as the attention's: every sequence of the
step in one launch, token by token), else torch's: decodes take one recurrent step each,
batched; a prefill chunk runs the chunked form of the same recurrence (chunks of 64 tokens:
the delta rule's triangular system solved once per chunk, then one state update per chunk),
from the state the sequence's earlier chunks left. They agree to float32 rounding
(tests/kernels/test_gated_delta_cpu.py, tests/kernels/test_gated_delta_triton.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagecli.layers.attention import AttentionMetadata
from pagecli.layers.linear import native_projection
from pagecli_kernels import fused_cpu
from pagecli_kernels import layer_ops as ops

CHUNK = 64  # tokens per block of the chunked recurrence


@dataclass(frozen=True)
class DeltaNetSpec:
    """One Gated DeltaNet layer's shape."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    eps: float
    # value head j reads key head j mod Hk (llama.cpp's GGUF order), not j // (Hv / Hk)
    v_heads_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state in this layer: the conv window in the model's dtype,
        S in float32."""
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.finfo(dtype).bits // 8
        return conv + 4 * self.num_v_heads * self.k_head_dim * self.v_head_dim


@dataclass
class StateStore:
    """A number of sequences' states in one Gated DeltaNet layer: conv windows [count,
    conv_dim, kernel - 1] in the model's dtype, recurrent states [count, Hv, dk, dv] in
    float32. The engine keeps three per layer: the running sequences' slots, the snapshots for
    prefix hits, and host slots for swapped-out sequences."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def zeros(
        cls, spec: DeltaNetSpec, count: int, dtype: torch.dtype, device, pin: bool = False
    ) -> StateStore:
        conv = (count, spec.conv_dim, spec.conv_kernel - 1)
        ssm = (count, spec.num_v_heads, spec.k_head_dim, spec.v_head_dim)
        return cls(
            torch.zeros(conv, dtype=dtype, device=device, pin_memory=pin),
            torch.zeros(ssm, dtype=torch.float32, device=device, pin_memory=pin),
        )

    def copy_(self, pairs: list[tuple[int, int]], source: StateStore) -> None:
        """(from, to) pairs: entry `to` of this store takes entry `from` of `source` (which
        may be this store, or one on another device)."""
        if not pairs:
            return
        src, dst = [a for a, _ in pairs], [b for _, b in pairs]
        self.conv[dst] = source.conv[src].to(self.conv.device)
        self.ssm[dst] = source.ssm[src].to(self.ssm.device)

    def zero_(self, entries: list[int]) -> None:
        if entries:
            self.conv[entries] = 0
            self.ssm[entries] = 0


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [N, H, dk], v [N, H, dv], g, beta [N, H] (float32, q
    already normalized and scaled); state [N, H, dk, dv], updated in place and returned with
    o [N, H, dv]. Three passes over the state (decay, the rank-1 update, o's read) as batched
    matrix products: the state is the bytes a decode step reads here."""
    n, heads, dk, dv = state.shape
    s = state.view(n * heads, dk, dv)
    s.mul_(g.exp().reshape(n * heads, 1, 1))
    k = k.reshape(n * heads, 1, dk)
    predicted = torch.bmm(k, s)  # S^T k: [NH, 1, dv]
    delta = (v.reshape(n * heads, 1, dv) - predicted) * beta.reshape(n * heads, 1, 1)
    s.baddbmm_(k.transpose(1, 2), delta)
    out = torch.bmm(q.reshape(n * heads, 1, dk), s)
    return out.view(n, heads, dv), state


def chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one sequence's n tokens, CHUNK at a time: q, k [H, n, dk], v [H, n,
    dv], g, beta [H, n] (float32, q normalized and scaled); state [H, dk, dv]. Returns (o [H,
    n, dv], the state after the last token).

    Within a chunk, with G_t the running sum of g from its start: every token's correction
    u_t = beta_t (v_t - S_{t-1}^T k_t) depends on the earlier ones through a unit lower
    triangular system (I + A) U = beta V - diag(beta e^G) K S0 with A_ij = beta_i e^(G_i - G_j)
    k_i.k_j (i > j); then o = (q e^G) S0 + tril(q k^T e^(G_i - G_j)) U and the state leaves as
    e^G_last S0 + (k e^(G_last - G))^T U."""
    heads, n, dk = k.shape
    out = torch.empty(heads, n, v.shape[-1], dtype=v.dtype, device=v.device)
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        bc = beta[:, start:end, None]
        cum = g[:, start:end].cumsum(-1)  # G: [H, L]
        length = end - start
        lower = torch.ones(length, length, dtype=torch.bool, device=v.device).tril()
        # e^(G_i - G_j) for j <= i; 0 above the diagonal (masked before exp: no overflow)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        system = ((bc * kc) @ kc.transpose(-1, -2)) * decay  # its diagonal is taken as 1
        rhs = torch.cat([bc * vc, bc * kc * cum.exp()[..., None]], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u = solved[..., : vc.shape[-1]] - solved[..., vc.shape[-1] :] @ state
        attn = (qc @ kc.transpose(-1, -2)) * decay
        out[:, start:end] = (qc * cum.exp()[..., None]) @ state + attn @ u
        last = cum[:, -1:]  # [H, 1]
        state = (
            state * last.exp()[..., None]
            + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
        )
    return out, state


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * w * silu(gate) per head, in float32 (w applied before the gate)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer over the step's flat tokens; its states live in the slots the
    engine gives (`slots`, a StateStore set by the model runner, beside its `snapshots` and
    `host` stores) and AttentionMetadata.state_slots picks each sequence's."""

    def __init__(self, spec: DeltaNetSpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        s = spec
        self.in_proj = nn.Linear(hidden_size, s.conv_dim + s.value_dim + 2 * s.num_v_heads, False)
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.v_head_dim, s.eps)
        self.out_proj = nn.Linear(s.value_dim, hidden_size, bias=False)
        self.slots: StateStore | None = None
        self.snapshots: StateStore | None = None
        self.host: StateStore | None = None
        self.impl = "auto"  # the recurrence's kernels, as PagedAttention.impl (model runner)
        self._native: tuple[torch.Tensor, ...] | None = None  # native_weights(), made once

    @property
    def part_sizes(self) -> dict[str, list[int]]:
        """in_proj's parts, as transformers' checkpoints hold them: q/k/v, z, b, a."""
        s = self.spec
        return {"in_proj": [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads]}

    def native_weights(self) -> tuple[torch.Tensor, ...]:
        """The conv kernel [C, K], A = -exp(A_log) and dt_bias [Hv], the norm's weight [dv],
        as the native step takes them (float32, contiguous; made once, after loading)."""
        if self._native is None:
            with torch.no_grad():
                self._native = (
                    self.conv1d.weight[:, 0].float().contiguous(),
                    (-self.A_log.float().exp()).contiguous(),
                    self.dt_bias.float().contiguous(),
                    self.norm.weight.float().contiguous(),
                )
        return self._native

    def native_takes(self, projected: torch.Tensor) -> bool:
        """Whether the native step runs on this input projection (float32 CPU rows, float32
        state stores, native kernels on)."""
        return (
            self.impl in ("auto", "cpu")
            and fused_cpu.available(projected)
            and projected.dtype == torch.float32
            and projected.stride(-1) == 1
            and self.slots is not None
            and self.slots.conv.dtype == torch.float32
        )

    def program(self, src: str, dst: str) -> list[ops.Op] | None:
        """This layer as layer-program ops from `src` (normed hidden) into `dst` (out_proj's
        output); None when a weight or store is not one the ops take."""
        s = self.spec
        in_proj, out_proj = native_projection(self.in_proj), native_projection(self.out_proj)
        if in_proj is None or out_proj is None or self.slots is None:
            return None
        if self.impl not in ("auto", "cpu"):
            return None
        if self.slots.conv.dtype != torch.float32:
            return None
        conv, a, dt_bias, norm = self.native_weights()
        return [
            ops.Linear(src, "mixed", *in_proj),
            ops.DeltaNet(
                "mixed", "values", conv, a, dt_bias, norm, self.norm.eps, self.slots.conv,
                self.slots.ssm, s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim,
                s.v_heads_tiled,
            ),
            ops.Linear("values", dst, *out_proj),
        ]  # fmt: skip

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        num_tokens = hidden.shape[0]
        projected = self.in_proj(hidden)  # [T, C + Hv dv + 2 Hv]
        if self.native_takes(projected):
            values = fused_cpu.gated_delta(
                projected, self.native_weights(), self.norm.eps, self.slots.conv,
                self.slots.ssm, meta.state_slots, meta.state_starts,
                (s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim), s.v_heads_tiled,
            )  # fmt: skip
            return self.out_proj(values.to(hidden.dtype))
        mixed, z, b, a = projected.split(
            [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], dim=-1
        )
        mixed = self._conv(mixed, meta)  # [T, conv_dim]
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        repeat = s.num_v_heads // s.num_k_heads
        q = q.reshape(num_tokens, s.num_k_heads, s.k_head_dim).float()
        k = k.reshape(num_tokens, s.num_k_heads, s.k_head_dim).float()
        if self.impl == "triton" or (self.impl == "auto" and hidden.device.type == "cuda"):
            return self._triton_rest(hidden, q, k, v, z, b, a, meta)
        if repeat > 1 and s.v_heads_tiled:
            q, k = q.repeat(1, repeat, 1), k.repeat(1, repeat, 1)
        elif repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        q = l2_normalize(q) * s.k_head_dim**-0.5  # [T, Hv, dk]
        k = l2_normalize(k)
        v = v.reshape(num_tokens, s.num_v_heads, s.v_head_dim).float()  # [T, Hv, dv]
        beta = b.float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = torch.empty_like(v)
        slots = meta.state_slots
        num_decode = meta.num_decode_tokens
        if num_decode:
            rows = slots[:num_decode]
            if num_decode == 1:  # its slot in place (a view): no gather, no scatter
                slot = int(rows[0])
                state = self.slots.ssm[slot : slot + 1]
            else:
                state = self.slots.ssm[rows]
            o, new = recurrent_step(
                q[:num_decode], k[:num_decode], v[:num_decode], g[:num_decode],
                beta[:num_decode], state,
            )  # fmt: skip
            if num_decode > 1:
                self.slots.ssm[rows] = new
            out[:num_decode] = o
        if num_tokens > num_decode:
            starts = meta.prefill_query_start_loc.tolist()
            for i, slot in enumerate(slots[num_decode:].tolist()):
                lo, hi = num_decode + starts[i], num_decode + starts[i + 1]
                o, new = chunked_rule(
                    q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1),
                    v[lo:hi].transpose(0, 1), g[lo:hi].t(), beta[lo:hi].t(),
                    self.slots.ssm[slot],
                )  # fmt: skip
                self.slots.ssm[slot] = new
                out[lo:hi] = o.transpose(0, 1)
        o = self.norm(out.to(hidden.dtype), z.reshape(num_tokens, s.num_v_heads, s.v_head_dim))
        return self.out_proj(o.reshape(num_tokens, s.value_dim))

    def _triton_rest(self, hidden, q, k, v, z, b, a, meta: AttentionMetadata) -> torch.Tensor:
        """The recurrence of every sequence in one Triton launch, then the gated norm and
        out_proj; q, k [T, Hk, dk] (not yet normalized), v, z, b, a as split."""
        from pagecli_kernels.gated_delta import gated_delta_recurrence

        s = self.spec
        num_tokens = hidden.shape[0]
        q = l2_normalize(q) * s.k_head_dim**-0.5
        k = l2_normalize(k)
        v = v.reshape(num_tokens, s.num_v_heads, s.v_head_dim).float()
        beta = b.float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = gated_delta_recurrence(
            q, k, v, g, beta, self.slots.ssm, meta.state_slots, meta.state_starts,
            s.v_heads_tiled,
        )  # fmt: skip
        o = self.norm(out.to(hidden.dtype), z.reshape(num_tokens, s.num_v_heads, s.v_head_dim))
        return self.out_proj(o.reshape(num_tokens, s.value_dim))

    def _conv(self, mixed: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The causal depthwise conv (then silu) of each sequence's new rows after the last
        kernel - 1 inputs its slot keeps; the slot keeps the new last ones."""
        weight = self.conv1d.weight[:, 0]  # [C, kernel]
        width = weight.shape[1] - 1
        out = torch.empty_like(mixed)
        slots = meta.state_slots
        num_decode = meta.num_decode_tokens
        if num_decode:
            rows = slots[:num_decode]
            window = torch.cat([self.slots.conv[rows], mixed[:num_decode, :, None]], dim=-1)
            out[:num_decode] = (window * weight).sum(-1)  # [D, C]
            self.slots.conv[rows] = window[..., 1:]
        if mixed.shape[0] > num_decode:
            starts = meta.prefill_query_start_loc.tolist()
            taps = weight.t()  # [kernel, C]
            for i, slot in enumerate(slots[num_decode:].tolist()):
                lo, hi = num_decode + starts[i], num_decode + starts[i + 1]
                # token-major [w + n, C]: the kept inputs, then the chunk's; each output row
                # sums its kernel's taps over the rows before it (no transposes)
                seq = torch.cat([self.slots.conv[slot].t(), mixed[lo:hi]])
                n = hi - lo
                acc = seq[:n] * taps[0]
                for j in range(1, width + 1):
                    acc.addcmul_(seq[j : j + n], taps[j])
                out[lo:hi] = acc
                self.slots.conv[slot] = seq[n:].t()
        return F.silu(out)
