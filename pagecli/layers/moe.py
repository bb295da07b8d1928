"""A sparse mixture-of-experts MLP: a router picks `top_k` of `num_experts` gated MLPs per
token and sums their outputs by the routing weights.

The router is transformers' for Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE: logits = gate(x), a
float32 softmax over all experts, the top k kept, and with `norm_topk_prob` renormalized to
sum to 1 (Mixtral always), then cast back to the activations' dtype. gpt-oss's
("topk_softmax") takes the top k of the logits (its router has a bias) and a softmax over
those k in the activations' dtype; its experts have biases and the clamped SwiGLU
("swiglu_oai": (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
limit)). Qwen2-MoE's shared expert adds sigmoid(shared_expert_gate(x)) * shared_expert(x) to
every token.

Each expert is a gated MLP with transformers' per-expert names (`experts.{e}.gate_proj`,
`up_proj`, `down_proj`, gate and up fused as in the dense MLP), so a checkpoint's experts load
as any projection does: quantized at load, or, from a GGUF file, as row ranges of the file's
3-D expert tensors (views of its map: loader/gguf_weights.py). The step runs each expert that
some token chose once, over all of its tokens, in ascending expert order, and adds each
token's weighted outputs in that order (transformers' order).

On the CPU with float32 activations the whole block is one native call
(csrc/layer_program_cpu.c: `pagecli_moe`, and OP_MOE of the layer program, the same code):
the router, the softmax and top k, each chosen expert's projections over its gathered rows
with the quantized kernels, the weighted sums, the shared expert. On CUDA (`impl`, as the
attention's) the routed experts run as two grouped Triton launches over the experts' weights
stacked once (pagecli_kernels/fused_moe.py; each expert's projections become views of the
stacks). Elsewhere torch runs the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pagecli.layers.linear import native_projection
from pagecli.layers.parallel import TensorParallel
from pagecli.models.base import Split
from pagecli_kernels import fused_cpu
from pagecli_kernels import layer_ops as ops


@dataclass(frozen=True)
class MoESpec:
    """One layer's sparse MoE MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    activation: str = "silu"  # "silu", "gelu_tanh" or "swiglu_oai" (gpt-oss)
    norm_topk_prob: bool = False
    shared_intermediate_size: int | None = None  # Qwen2-MoE's shared expert, gated
    routing: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702  # "swiglu_oai"'s
    swiglu_limit: float = 7.0
    # the tensor-parallel axis of each expert's columns (loader/shards.py):
    # "expert_intermediate" where the config gives moe_intermediate_size, else the MLP's
    tp_axis: str = "intermediate"


class Expert(nn.Module):
    """One gated MLP: down(act(gate(x)) * up(x)), gate and up in one projection."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, spec: MoESpec, bias: bool = False
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.spec = spec
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.axis = spec.tp_axis

    @property
    def part_sizes(self) -> dict[str, list[int]]:
        return {"gate_up_proj": [self.intermediate_size] * 2}

    def tp_splits(self) -> dict[str, Split]:
        """Every rank holds its share of this expert's columns (`axis`: the MoE's)."""
        axis = self.axis
        return {
            "gate_up_proj": Split("column", ((axis, 1), (axis, 1))),
            "down_proj": Split("row", ((axis, 1),)),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activate(self.gate_up_proj(x), self.spec))


def activate(gate_up: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """The experts' activation of gate_up rows [N, 2 I] (gate first) -> [N, I]."""
    inter = gate_up.shape[-1] // 2
    native = fused_cpu.available(gate_up) and gate_up.stride(-1) == 1
    if spec.activation == "swiglu_oai":
        alpha, limit = spec.swiglu_alpha, spec.swiglu_limit
        if native:
            return fused_cpu.swiglu_oai(gate_up, alpha, limit)
        gate, up = gate_up.split(inter, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if native:
        return fused_cpu.act_mul(gate_up, spec.activation)
    gate, up = gate_up.split(inter, dim=-1)
    return (F.silu(gate) if spec.activation == "silu" else F.gelu(gate, "tanh")) * up


class SparseMoE(nn.Module):
    """The router (`gate`), the experts, and an optional gated shared expert."""

    def __init__(self, spec: MoESpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        self.intermediate_size = spec.intermediate_size
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=spec.router_bias)
        self.experts = nn.ModuleList(
            Expert(hidden_size, spec.intermediate_size, spec, spec.expert_bias)
            for _ in range(spec.num_experts)
        )
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = Expert(hidden_size, spec.shared_intermediate_size, spec)
            self.shared_expert.axis = "shared_intermediate"
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self._table: tuple | None = None  # (native_table(),), made once after loading
        # tensor parallelism: each expert holds this rank's columns, and the MoE's output
        # (every expert's and the shared expert's partial sums) is all-reduced once
        self.tp: TensorParallel | None = None
        self.impl = "auto"  # the routed experts' kernels, as PagedAttention.impl (model runner)
        self._stacks: tuple | None = None  # (stacked(),), made on the first Triton step

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] of x's dtype, experts [T, k] int64) for tokens x [T, H]."""
        logits = self.gate(x)  # [T, E]
        if self.spec.routing == "topk_softmax":
            top, experts = torch.topk(logits, self.spec.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype).to(x.dtype), experts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def native_table(self) -> tuple[torch.Tensor, tuple] | None:
        """The MOE_FIELDS table the native MoE reads (router, each expert's projections, the
        shared expert's), with the tensors it points into; None when some projection is not
        one the native kernels take (a float part, a bias). Built once, after loading."""
        if self._table is None:
            self._table = (self._build_table(),)
        return self._table[0]

    def _build_table(self) -> tuple[torch.Tensor, tuple] | None:
        from pagecli_kernels import layers_cpu

        keep: list = []

        def table(module: nn.Module) -> int | None:
            found = native_projection(module)
            if found is None:
                return None
            try:
                t = layers_cpu.projection_table(*found)
            except ValueError:
                return None
            keep.extend([t, *found[0]])
            return t.data_ptr()

        s = self.spec
        router = table(self.gate)
        experts = [table(m) for e in self.experts for m in (e.gate_up_proj, e.down_proj)]
        shared = [0, 0, 0]
        if self.shared_expert is not None:
            e = self.shared_expert
            shared = [table(e.gate_up_proj), table(e.down_proj), table(self.shared_expert_gate)]
        if router is None or None in experts or None in shared:
            return None
        pairs = torch.tensor(experts, dtype=torch.int64)  # [E, 2] projection tables
        keep.append(pairs)
        acts = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}
        if s.activation not in acts:
            return None
        fields = [s.num_experts, s.top_k, int(s.norm_topk_prob), s.intermediate_size]
        fields += [acts[s.activation], router, pairs.data_ptr()]
        fields += [s.shared_intermediate_size or 0, *shared]
        fields += [int(s.routing == "topk_softmax")]
        fields += [layers_cpu.float_bits(s.swiglu_alpha), layers_cpu.float_bits(s.swiglu_limit)]
        return torch.tensor(fields, dtype=torch.int64), tuple(keep)  # [MOE_FIELDS]

    def program(self, src: str, dst: str) -> list[ops.Op] | None:
        """This MoE as a layer-program op; None when its projections cannot take one."""
        found = self.native_table()
        if found is None:
            return None
        program: list[ops.Op] = [ops.MoE(src, dst, found[0], found[1])]
        if self.tp is not None:
            program.append(ops.AllReduce(dst))
        return program

    def stacked(self) -> tuple | None:
        """The experts' weights as the Triton kernels take them: (gate_up [E, 2I, H], down
        [E, H, I], their biases [E, 2I] and [E, H] or None), made once. Float tensors (CUDA)
        become views of the stacks, so they are held once; the CPU's float32 rows (a
        QuantLinear's F32 parts: Triton's interpreter, for tests) are copied. None where an
        expert's projections are in block formats."""
        if self._stacks is None:
            self._stacks = (self._stack(),)
        return self._stacks[0]

    def _stack(self) -> tuple | None:
        experts = list(self.experts)
        stacks = []
        for kind in ("gate_up_proj", "down_proj"):
            modules = [getattr(e, kind) for e in experts]
            if all(type(m) is nn.Linear for m in modules):
                for leaf in ("weight", "bias"):
                    if getattr(modules[0], leaf) is None:
                        stacks.append(None)
                        continue
                    stack = torch.stack([getattr(m, leaf).data for m in modules])
                    for i, m in enumerate(modules):
                        getattr(m, leaf).data = stack[i]  # a view: the stack holds it
                    stacks.append(stack)
            elif all(getattr(m, "formats", None) == ["float32"] * len(m.parts) for m in modules):
                rows = [torch.cat([p.data.view(torch.float32) for p in m.parts]) for m in modules]
                stacks.append(torch.stack(rows))
                biases = [m.bias for m in modules]
                stacks.append(None if biases[0] is None else torch.stack([b.data for b in biases]))
            else:
                return None
        gate_up, gate_up_bias, down, down_bias = stacks
        return gate_up, down, gate_up_bias, down_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "triton" or (self.impl == "auto" and x.device.type == "cuda"):
            stacks = self.stacked()
            if stacks is not None and x.dim() == 2:
                return self._triton(x, stacks)
        if x.dtype == torch.float32 and x.dim() == 2 and fused_cpu.available(x):
            found = self.native_table()
            if found is not None:  # the layer program's kernel, over the same tables
                out = fused_cpu.moe(x, found[0])
                return out if self.tp is None else self.tp.all_reduce(out)
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)  # [T, H]
        for expert in chosen.unique().tolist():  # ascending
            rows, slot = torch.where(chosen == expert)
            y = self.experts[expert](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return self._shared_and_sum(x, out)

    def _triton(self, x: torch.Tensor, stacks: tuple) -> torch.Tensor:
        from pagecli_kernels import fused_moe

        weights, chosen = self.route(x)
        gate_up, down, gate_up_bias, down_bias = stacks
        out = fused_moe.fused_moe(
            x, weights, chosen, gate_up, down, lambda rows: activate(rows, self.spec),
            gate_up_bias, down_bias,
        )  # fmt: skip
        return self._shared_and_sum(x, out)

    def _shared_and_sum(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum `out` with the shared expert's gated output, all-reduced
        under tensor parallelism."""
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)
