"""The building blocks the decoder families share, and the generic decoder built from them.

A family describes its model as a `ModelSpec` (models/<family>.py: `model_spec(config)`), and
`DecoderModel` builds it: per layer an `Attention` (q/k/v fused, biases, q/k norm per head or
over the whole projection, rotary of one of the model's RoPE tables or none, a sliding window,
sinks), a gated `MLP` (silu or gelu-tanh), and the norms placed as the family places them:

  "pre"       Llama:   h += attn(norm(h));                 h += mlp(norm(h))
  "sandwich"  Gemma:   h += norm(attn(norm(h)));           h += norm(mlp(norm(h)))
  "post"      OLMo 2:  h += norm(attn(h));                 h += norm(mlp(h))

with Granite's residual multiplier on each branch, and the model's scaled embeddings, final
norm, logit divisor and soft-cap. The same description gives the CPU's one-call path its layer
program (`DecoderLayer.program`), op for op what `forward` does, so that both give the same
bits (tests/kernels/test_layers_cpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pagecli.layers.attention import AttentionMetadata, PagedAttention
from pagecli.layers.gated_delta import DeltaNetSpec, GatedDeltaNet
from pagecli.layers.linear import BF16Linear, native_projection
from pagecli.layers.moe import MoESpec, SparseMoE
from pagecli.layers.norm import NormStyle, RMSNorm
from pagecli.layers.parallel import TensorParallel
from pagecli.layers.rotary import RotaryEmbedding, apply_rotary
from pagecli.models.base import WHOLE, CausalLM, KVLayout, Split
from pagecli_kernels import fused_cpu, layers_cpu
from pagecli_kernels import layer_ops as ops

Activation = Literal["silu", "gelu_tanh"]
# transformers' activation names -> the kernels'
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) for the step's positions, [T, 1, R]


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention. `rope`: the key of the model's RoPE table it rotates with (a
    layer type of the config, or "default"), None for a layer without positions (NoPE)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: Literal["head", "full"] | None = None
    rope: str | None = "default"
    window: int | None = None
    sinks: bool = False
    # Qwen3.5's gated attention: q_proj gives each head's query and a gate side by side, and
    # the attention output is multiplied by sigmoid(gate) before o_proj
    output_gate: bool = False


@dataclass(frozen=True)
class MLPSpec:
    """One layer's gated MLP: down(act(gate(x)) * up(x))."""

    intermediate_size: int
    activation: Activation = "silu"
    bias: bool = False


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its attention, or a Gated DeltaNet (`linear`: Qwen3.5's linear-
    attention layers, with a state slot per sequence instead of a KV cache), its MLP, where
    its norms sit (see the module docstring) and Granite's multiplier of each branch before
    it joins the residual."""

    attention: AttentionSpec | None
    mlp: MLPSpec | MoESpec  # MoESpec: a sparse mixture of experts (layers/moe.py)
    norms: Literal["pre", "sandwich", "post"] = "pre"
    residual_multiplier: float | None = None
    linear: DeltaNetSpec | None = None


@dataclass(frozen=True)
class ModelSpec:
    """A whole decoder: its layers and what surrounds them. `embedding_multiplier` scales the
    looked-up rows (Gemma: sqrt(hidden) rounded to the model's dtype first, as transformers
    makes it a tensor of that dtype: `embedding_multiplier_rounded`; Granite: a plain
    float); the logits are divided by `logits_divisor` (Granite) and soft-capped at
    `logit_softcap` (cap * tanh(logits / cap))."""

    layers: tuple[LayerSpec, ...]
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    norm_style: NormStyle = "rounded"
    tie_word_embeddings: bool = False
    embedding_multiplier: float | None = None
    embedding_multiplier_rounded: bool = False
    logits_divisor: float | None = None
    logit_softcap: float | None = None

    @classmethod
    def of(cls, config, layers, tied: bool = False, **extra) -> ModelSpec:
        """The spec of `layers` with the vocabulary, hidden size, RMSNorm eps and tied
        embeddings of transformers' `config` (`tied` where the config leaves them out), and a
        family's `extra` fields."""
        return cls(
            layers=tuple(layers),
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", tied)),
            **extra,
        )


def moe_spec(config, norm_topk_prob: bool) -> MoESpec:
    """The sparse MoE MLP of `config` (transformers' attributes: num_local_experts or
    num_experts, num_experts_per_tok, moe_intermediate_size or intermediate_size,
    shared_expert_intermediate_size); ValueError for a router pagecli does not know or an
    expert count that makes no sense."""
    scoring = getattr(config, "scoring_func", None) or "softmax"
    if scoring != "softmax":
        raise ValueError(f"router scoring {scoring!r} is not supported (softmax is)")
    num_experts = int(
        getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    )
    top_k = int(config.num_experts_per_tok)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{top_k} experts per token of {num_experts}")
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=inter,
        activation=activation(config),
        norm_topk_prob=norm_topk_prob,
        shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", None),
        tp_axis="expert_intermediate"
        if getattr(config, "moe_intermediate_size", None)
        else ("intermediate"),
    )


def with_experts(config, layers: tuple[LayerSpec, ...], moe: MoESpec) -> tuple[LayerSpec, ...]:
    """`layers` with the sparse MLP where transformers puts one: every layer but those of
    `mlp_only_layers`, every `decoder_sparse_step`-th."""
    import dataclasses

    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return tuple(
        layer if i in dense_only or (i + 1) % step else dataclasses.replace(layer, mlp=moe)
        for i, layer in enumerate(layers)
    )


def activation(config, key: str = "hidden_act") -> Activation:
    """The kernels' name of the config's MLP activation; ValueError for one pagecli lacks."""
    name = getattr(config, key, None) or "silu"
    if name not in ACTIVATIONS:
        known = ", ".join(sorted(ACTIVATIONS))
        raise ValueError(f"unsupported activation {name!r} (supported: {known})")
    return ACTIVATIONS[name]


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window from transformers' conventions: `layer_types` naming
    "sliding_attention" layers, else every layer when `sliding_window` is set and enabled
    (`use_sliding_window` where the config has it). ValueError for a layer type pagecli
    does not know."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    num_layers = config.num_hidden_layers
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported layer type {unknown[0]!r}")
        if len(types) != num_layers:
            raise ValueError(f"layer_types lists {len(types)} layers for {num_layers}")
        if "sliding_attention" in types and not window:
            raise ValueError("sliding_attention layers without a sliding_window")
        return [window if t == "sliding_attention" else None for t in types]
    if window and getattr(config, "use_sliding_window", True):
        return [window] * num_layers
    return [None] * num_layers


def check_window(window: int | None) -> int | None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window!r}")
    return window


class Attention(nn.Module):
    """q/k/v in one projection, optional q/k norms and rotary, paged attention, output."""

    def __init__(self, spec: AttentionSpec, hidden_size: int, eps: float, style: NormStyle):
        super().__init__()
        self.spec = spec
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.q_rows = 2 * self.q_size if spec.output_gate else self.q_size  # with the gates
        self.qkv_proj = nn.Linear(hidden_size, self.q_rows + 2 * self.kv_size, spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, spec.o_bias)
        self.q_norm = self.k_norm = None
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(spec.head_dim, eps, style)
            self.k_norm = RMSNorm(spec.head_dim, eps, style)
        elif spec.qk_norm == "full":
            self.q_norm = RMSNorm(self.q_size, eps, style)
            self.k_norm = RMSNorm(self.kv_size, eps, style)
        self.sinks = None
        if spec.sinks:
            self.sinks = nn.Parameter(torch.empty(spec.num_heads, dtype=torch.float32))
        self.attn = PagedAttention(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale, spec.window
        )
        # q/k weight rows in llama.cpp's order (each head's rotary halves interleaved, as a
        # GGUF file keeps them in place): the rotary reads each head's pairs back into halves
        self.qk_pairs = False
        # tensor parallelism: this rank's heads only; o_proj's partial sums are all-reduced
        self.tp: TensorParallel | None = None

    @property
    def part_sizes(self) -> dict[str, list[int]]:
        """The output rows of each part of the fused projections (models/weight_methods.py)."""
        return {"qkv_proj": [self.q_rows, self.kv_size, self.kv_size]}

    def post_load(self) -> None:
        if self.sinks is not None:  # the kernels read them as float32
            self.attn.sinks = self.sinks.detach().float().contiguous()

    def tp_splits(self) -> dict[str, Split]:
        d = self.head_dim
        splits = {
            "qkv_proj": Split("column", (("q_heads", d), ("kv_heads", d), ("kv_heads", d))),
            "o_proj": Split("row", (("q_heads", d),)),
            "sinks": Split("column", (("q_heads", 1),)),
        }
        if self.spec.qk_norm == "full":
            reason = "its q/k norms span every head (a rank holds only some)"
            splits["q_norm"] = splits["k_norm"] = Split("none", reason=reason)
        return splits

    def forward(self, rope: Rope | None, hidden: torch.Tensor, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, Q + 2 KV] (Q twice with the gates)
        q, k, v = qkv.split([self.q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.spec.output_gate:  # each head's query, then its gate
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q = q.contiguous()  # heads back to back, as the layer program splits them
            gate = gate.reshape(num_tokens, self.q_size)
        if self.spec.qk_norm == "full":  # over the whole projection, before the heads
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, k, *rope, pairs=self.qk_pairs)
        out = self.attn(q, k, v.contiguous(), meta)  # [T, Hq, D]
        out = out.reshape(num_tokens, self.q_size)
        if gate is not None and fused_cpu.gate_mul_takes(out, gate):
            fused_cpu.gate_mul_(out, gate)  # the layer program's kernel
        elif gate is not None:
            out = out * torch.sigmoid(gate)
        out = self.o_proj(out)  # [T, H]
        return out if self.tp is None else self.tp.all_reduce(out)

    def program(self, src: str, dst: str, rope_index: int | None) -> list[ops.Op] | None:
        """This attention as native ops from buffer `src` (normed hidden) into `dst` (its
        output projection); None when a weight or cache is not one the ops take."""
        qkv = native_projection(self.qkv_proj)
        o = native_projection(self.o_proj)
        attn = self.attn
        if (
            qkv is None
            or o is None
            or attn.impl not in ("auto", "cpu")
            or not all(_row_cache(c, self.head_dim) for c in (attn.k_cache, attn.v_cache))
        ):
            return None
        q_size, kv_size, d = self.q_size, self.kv_size, self.head_dim
        k_col = self.q_rows  # past the queries (and their gates)
        program: list[ops.Op] = [ops.Linear(src, "qkv", *qkv)]
        if self.spec.output_gate:  # each head's query then its gate -> queries, then gates
            program.append(ops.SplitHeads("qkv", 0, self.num_heads, d))
        if self.q_norm is not None:
            heads = (self.num_heads, self.num_kv_heads) if self.spec.qk_norm == "head" else (1, 1)
            for norm, col, n in ((self.q_norm, 0, heads[0]), (self.k_norm, k_col, heads[1])):
                weight, mode = norm.kernel_weight()
                width = norm.weight.shape[0]
                program.append(ops.Norm("qkv", "qkv", weight, norm.eps, width, mode, col, col, n))
        if rope_index is not None:
            program.append(
                ops.Rotary(
                    "qkv", 0, k_col, self.num_heads, self.num_kv_heads, d, rope_index,
                    self.qk_pairs,
                )
            )  # fmt: skip
        program.append(
            ops.Attention(
                "qkv",
                0,
                k_col,
                k_col + kv_size,
                "attn",
                attn.k_cache,
                attn.v_cache,
                self.num_heads,
                self.num_kv_heads,
                d,
                attn.window,
                attn.sinks,
                attn.scale,
                attn.kv_group,
            )
        )
        if self.spec.output_gate:
            program.append(ops.GateMul("attn", "qkv", q_size, q_size))
        program.append(ops.Linear("attn", dst, *o))
        if self.tp is not None:
            program.append(ops.AllReduce(dst))
        return program


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one projection."""

    def __init__(self, spec: MLPSpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * spec.intermediate_size, spec.bias)
        self.down_proj = nn.Linear(spec.intermediate_size, hidden_size, spec.bias)
        self.tp: TensorParallel | None = None  # this rank's columns; down_proj all-reduced

    @property
    def part_sizes(self) -> dict[str, list[int]]:
        """The output rows of each part of the fused projections (models/weight_methods.py)."""
        return {"gate_up_proj": [self.intermediate_size] * 2}

    def tp_splits(self) -> dict[str, Split]:
        return {
            "gate_up_proj": Split("column", (("intermediate", 1), ("intermediate", 1))),
            "down_proj": Split("row", (("intermediate", 1),)),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if fused_cpu.available(gate_up) and gate_up.stride(-1) == 1:
            act = fused_cpu.act_mul(gate_up, self.spec.activation)  # one native call
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            if self.spec.activation == "silu":
                act = F.silu(gate) * up
            else:
                act = F.gelu(gate, approximate="tanh") * up
        out = self.down_proj(act)  # [T, H]
        return out if self.tp is None else self.tp.all_reduce(out)

    def program(self, src: str, dst: str) -> list[ops.Op] | None:
        gate_up, down = native_projection(self.gate_up_proj), native_projection(self.down_proj)
        if gate_up is None or down is None:
            return None
        program: list[ops.Op] = [
            ops.Linear(src, "gate_up", *gate_up),
            ops.ActMul("gate_up", "act", self.intermediate_size, self.spec.activation),
            ops.Linear("act", dst, *down),
        ]
        if self.tp is not None:
            program.append(ops.AllReduce(dst))
        return program


class DecoderLayer(nn.Module):
    """One decoder layer of a `LayerSpec`; the norms carry transformers' names."""

    def __init__(self, spec: LayerSpec, hidden_size: int, eps: float, style: NormStyle):
        super().__init__()
        self.spec = spec
        if spec.linear is not None:
            if spec.norms != "pre" or spec.residual_multiplier is not None:
                raise ValueError("a Gated DeltaNet layer takes pre-norms only")
            self.linear_attn = GatedDeltaNet(spec.linear, hidden_size)
        else:
            self.self_attn = Attention(spec.attention, hidden_size, eps, style)
        if isinstance(spec.mlp, MoESpec):
            self.mlp = SparseMoE(spec.mlp, hidden_size)
        else:
            self.mlp = MLP(spec.mlp, hidden_size)
        names = {
            "pre": ("input_layernorm", "post_attention_layernorm"),
            "sandwich": (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ),
            "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
        }[spec.norms]
        for name in names:
            setattr(self, name, RMSNorm(hidden_size, eps, style))

    def _branch(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """hidden + out (times the residual multiplier), as transformers adds them."""
        m = self.spec.residual_multiplier
        return hidden + out if m is None else hidden + out * m

    def forward(self, rope: Rope | None, hidden: torch.Tensor, meta: AttentionMetadata):
        # The residual additions mirror transformers' order so float32 results agree closely.
        # hidden is this step's own tensor: a residual add followed by a norm goes in place,
        # fused with the norm.
        placement, m = self.spec.norms, self.spec.residual_multiplier
        if self.spec.linear is not None:
            mixed = self.linear_attn(self.input_layernorm(hidden), meta)  # [T, H]
            normed = self.post_attention_layernorm.add_forward(hidden, mixed)  # hidden += mixed
            return hidden + self.mlp(normed)
        if placement == "post":
            attn = self.post_attention_layernorm(self.self_attn(rope, hidden, meta))
            hidden = self._branch(hidden, attn)
            return self._branch(hidden, self.post_feedforward_layernorm(self.mlp(hidden)))
        attn = self.self_attn(rope, self.input_layernorm(hidden), meta)  # [T, H]
        if placement == "sandwich":
            attn = self.post_attention_layernorm(attn)
        next_norm = (
            self.pre_feedforward_layernorm
            if placement == "sandwich"
            else self.post_attention_layernorm
        )
        if m is None:
            normed = next_norm.add_forward(hidden, attn)  # hidden += attn
        else:
            hidden = self._branch(hidden, attn)
            normed = next_norm(hidden)
        out = self.mlp(normed)
        if placement == "sandwich":
            out = self.post_feedforward_layernorm(out)
        return self._branch(hidden, out)

    def program(self, rope_index: int | None) -> list[ops.Op] | None:
        """This layer as native ops over the step's buffers (hidden in and out), op for op
        what `forward` computes; None when some part cannot take them."""
        placement, m = self.spec.norms, self.spec.residual_multiplier

        def norm(module: RMSNorm, src: str, dst: str, delta: str | None = None) -> ops.Norm:
            weight, mode = module.kernel_weight()
            return ops.Norm(src, dst, weight, module.eps, weight.shape[0], mode, delta=delta)

        def add(src: str) -> ops.Add:
            return ops.Add("hidden", src, m)

        if self.spec.linear is not None:  # pre-norms, no multiplier (checked at __init__)
            mixer = self.linear_attn.program("normed", "proj")
            mlp = self.mlp.program("normed", "proj")
            if mixer is None or mlp is None:
                return None
            return [
                norm(self.input_layernorm, "hidden", "normed"),
                *mixer,
                norm(self.post_attention_layernorm, "hidden", "normed", delta="proj"),
                *mlp,
                add("proj"),
            ]

        if placement == "post":
            attn = self.self_attn.program("hidden", "proj", rope_index)
            mlp = self.mlp.program("hidden", "proj")
            if attn is None or mlp is None:
                return None
            return [
                *attn,
                norm(self.post_attention_layernorm, "proj", "proj"),
                add("proj"),
                *mlp,
                norm(self.post_feedforward_layernorm, "proj", "proj"),
                add("proj"),
            ]
        attn = self.self_attn.program("normed", "proj", rope_index)
        mlp = self.mlp.program("normed", "proj")
        if attn is None or mlp is None:
            return None
        program = [norm(self.input_layernorm, "hidden", "normed"), *attn]
        if placement == "sandwich":
            program.append(norm(self.post_attention_layernorm, "proj", "proj"))
        next_norm = (
            self.pre_feedforward_layernorm
            if placement == "sandwich"
            else self.post_attention_layernorm
        )
        if m is None:
            program.append(norm(next_norm, "hidden", "normed", delta="proj"))
        else:
            program += [add("proj"), norm(next_norm, "hidden", "normed")]
        program += mlp
        if placement == "sandwich":
            program.append(norm(self.post_feedforward_layernorm, "proj", "proj"))
        program.append(add("proj"))
        return program


class DecoderModel(CausalLM):
    """A decoder-only model built from a family's `ModelSpec` (`model_spec(config)`).

    With `tp` (tensor parallelism), `config` is this rank's (loader/shards.py: its heads and
    MLP width) and the module holds its shard: the embedding and the output projection hold
    its vocabulary rows, and compute_logits returns only those columns."""

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        """The family's description of `config`; ValueError for what pagecli cannot run."""
        raise NotImplementedError

    @classmethod
    def check_config(cls, config) -> None:
        from pagecli.layers.rotary import rope_inv_freq

        spec = cls.model_spec(config)
        for key in sorted({s.attention.rope for s in spec.layers if s.attention} - {None}):
            rope_inv_freq(config, _rope_head_dim(spec, key), None if key == "default" else key)

    def __init__(self, config, max_position: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.spec = spec = self.model_spec(config)
        self.tp = tp
        vocab_rows = spec.vocab_size if tp is None else tp.shard.vocab[1] - tp.shard.vocab[0]
        # _weight: no reset_parameters (its normal_ imports torch._dynamo and triton, 1 s and
        # 130 MB at start-up); the loader or init_dummy_weights sets every weight anyway
        self.embed_tokens = nn.Embedding(
            vocab_rows,
            spec.hidden_size,
            _weight=torch.empty(vocab_rows, spec.hidden_size),
        )
        # one RoPE table per key the layers name, shared by those layers
        keys = sorted({s.attention.rope for s in spec.layers if s.attention} - {None})
        self.rope_keys = keys
        self.rotary = {
            key: RotaryEmbedding(
                config,
                _rope_head_dim(spec, key),
                max_position,
                None if key == "default" else key,
            )
            for key in keys
        }
        self.layers = nn.ModuleList(
            DecoderLayer(s, spec.hidden_size, spec.rms_norm_eps, spec.norm_style)
            for s in spec.layers
        )
        for layer in self.layers:
            layer.mlp.tp = tp
            if layer.spec.attention is not None:
                layer.self_attn.tp = tp
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_style)
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, vocab_rows, bias=False)
        # the output projection as the CPU's kernels take it (models/weight_methods.py)
        self.packed_head = None
        self.float_head = None
        self.bf16_head = None
        # the decoder layers bound for one native call (CPU), rebuilt when the caches or
        # attention implementations change; see native_layers()
        self._native: tuple[list, layers_cpu.LayerProgram | None] = ([], None)
        self._attention: list[PagedAttention] | None = None  # attention_layers, kept
        starts = {r.original_max_position for r in self.rotary.values()} - {None}
        if len(starts) > 1:
            raise ValueError(f"LongRoPE tables with different original contexts {starts}")
        self.long_rope_from = starts.pop() if starts else None

    def tp_splits(self) -> dict[str, Split]:
        return {"embed_tokens": Split("vocab"), "lm_head": Split("vocab"), "norm": WHOLE}

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers if layer.spec.attention]

    @property
    def moe_layers(self) -> list[SparseMoE]:
        """Each layer's sparse MoE MLP, in order (none for a dense model)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    @property
    def state_layers(self) -> list[GatedDeltaNet]:
        """The layers that keep a state per sequence instead of a KV cache, in order."""
        return [layer.linear_attn for layer in self.layers if layer.spec.linear is not None]

    def kv_layout(self) -> list[KVLayout]:
        return [
            KVLayout(
                a.num_kv_heads,
                a.head_dim,
                "full" if a.window is None else "sliding_window",
                a.window,
                layer.self_attn.sinks is not None,
            )
            for layer, a in zip(
                [layer for layer in self.layers if layer.spec.attention], self.attention_layers
            )
        ]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input rows [T, H], scaled as the family scales them."""
        if self.tp is None:
            hidden = self.embed_tokens(input_ids)  # [T, H]
        else:
            hidden = self.tp.embed(self.embed_tokens, input_ids)  # [T, H]
        m = self.spec.embedding_multiplier
        if m is not None and self.spec.embedding_multiplier_rounded:
            hidden = hidden * torch.tensor(m).to(hidden.dtype)  # Gemma: a float32 tensor, cast
        elif m is not None:
            hidden = hidden * m
        return hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)  # [T, H]
        long_rows = meta.long_rope_rows if self.long_rope_from is not None else None
        ropes = {key: rotary(positions, long_rows) for key, rotary in self.rotary.items()}
        native = self.native_layers(hidden, ropes)
        if native is not None:  # the same kernels as the loop below, in one call
            tables = [(cos[:, 0], sin[:, 0]) for cos, sin in (ropes[k] for k in self.rope_keys)]
            shm = self.tp.shm if self.tp is not None else None
            normed = native(
                hidden, tables, meta.slot_mapping, _groups(meta), shm, meta.state_slots,
                meta.state_starts,
            )  # fmt: skip
            return normed if normed is not None else self.norm(hidden)  # the last norm in C too
        for layer in self.layers:
            key = layer.spec.attention.rope if layer.spec.attention else None
            hidden = layer(None if key is None else ropes[key], hidden, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the selected positions: [S, H] -> [S, V] (with `tp`, this
        rank's vocabulary columns)."""
        logits = self._head(hidden)
        if self.spec.logits_divisor is not None:
            logits = logits / self.spec.logits_divisor
        cap = self.spec.logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        from pagecli.layers.quant_linear import QuantEmbedding
        from pagecli_kernels import quant_cpu

        if self.float_head is not None and hidden.dtype == torch.float32:
            return self.float_head(hidden.contiguous())
        if (
            self.bf16_head is not None
            and hidden.dtype == torch.bfloat16
            and BF16Linear.native_takes(hidden.shape[0])
        ):  # rounded to bfloat16 first, as the bfloat16 product below returns them
            logits = quant_cpu.bf16_linear(hidden, self.bf16_head)
            return logits.to(torch.bfloat16).float()
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if isinstance(self.embed_tokens, QuantEmbedding):
            return self.embed_tokens.as_linear(hidden)
        return F.linear(hidden, self.embed_tokens.weight).float()

    @property
    def weight_formats(self) -> dict[str, list[str]]:
        """Each layer type's weight formats (models/weight_methods.py)."""
        from pagecli.models.weight_methods import weight_formats

        return weight_formats(self)

    def use_qk_pairs(self) -> None:
        """The checkpoint's Q/K weights (and biases) come in llama.cpp's row order, each
        head's rotary halves interleaved (a GGUF read in place): every attention layer
        deinterleaves its q and k outputs, so the rest of the model is unchanged."""
        for layer in self.layers:
            if layer.spec.attention is None:
                raise ValueError("a model with Gated DeltaNet layers takes no permuted Q/K rows")
            attn = layer.self_attn
            if attn.q_norm is not None:  # it would see the interleaved order
                raise ValueError("q/k norms need the checkpoint's q/k rows unpermuted")
            key = attn.spec.rope
            if key is not None and self.rotary[key].rotary_dim != attn.head_dim:
                raise ValueError("partial rotary needs the checkpoint's q/k rows unpermuted")
            attn.qk_pairs = True
        self._native = ([], None)  # rebind the one-call layers with the flag

    # ---- the CPU's one-call path ---------------------------------------------------------

    def native_layers(
        self, hidden: torch.Tensor, ropes: dict[str, Rope]
    ) -> layers_cpu.LayerProgram | None:
        """The decoder layers bound as one native layer program when this step can take it:
        float32 or bfloat16 activations and caches on the CPU, every projection in
        block-format or float32-rows buffers (one, or a QuantLinear's parts; bfloat16: the
        native kernels of `BF16Linear`, so only for steps that `BF16Linear.native_takes`,
        which the loop's layers also give to them), the CPU attention kernels; under tensor
        parallelism, float32 steps whose all-reduces fit the shared-memory collective. None:
        the Python loop runs."""
        shm = self.tp.shm if self.tp is not None else None
        if (
            (self.tp is not None and (shm is None or not shm.takes(hidden)))
            or hidden.dtype not in (torch.float32, torch.bfloat16)
            or (hidden.dtype == torch.bfloat16 and not BF16Linear.native_takes(hidden.shape[0]))
            or hidden.device.type != "cpu"
            or not hidden.is_contiguous()
            or any(c.dtype != hidden.dtype or not c.is_contiguous() for c, _ in ropes.values())
            or not layers_cpu.enabled()
        ):
            return None
        if self._attention is None:  # the layers never change; their caches and impl may
            self._attention = self.attention_layers
        key = [(id(a.k_cache), id(a.v_cache), a.kv_group, a.impl) for a in self._attention]
        key += [
            (id(s.slots.conv), id(s.slots.ssm)) for s in self.state_layers if s.slots is not None
        ]
        if key != self._native[0]:
            self._native = (key, self.layer_program())
        return self._native[1]

    def buffer_widths(self) -> dict[str, int]:
        """Values per token of each buffer of the layer program (layer_ops.BUFFERS)."""
        hidden = self.spec.hidden_size
        attentions = [layer.self_attn for layer in self.layers if layer.spec.attention]
        linear = [layer.spec.linear for layer in self.layers if layer.spec.linear]
        inter = max(layer.mlp.intermediate_size for layer in self.layers)
        return {
            "hidden": hidden,
            "normed": hidden,
            "qkv": max(a.q_rows + 2 * a.kv_size for a in attentions),
            "attn": max(a.q_size for a in attentions),
            "proj": hidden,
            "gate_up": 2 * inter,
            "act": inter,
            # a Gated DeltaNet layer's input projection and its values (1: none)
            "mixed": max((s.conv_dim + s.value_dim + 2 * s.num_v_heads for s in linear), default=1),
            "values": max((s.value_dim for s in linear), default=1),
        }

    def layer_program(self) -> layers_cpu.LayerProgram | None:
        """Every layer's ops bound into one native program; None when some layer, weight or
        cache cannot take it (the Python loop runs instead)."""
        program: list[ops.Op] = []
        for layer in self.layers:
            key = layer.spec.attention.rope if layer.spec.attention else None
            ops_of_layer = layer.program(None if key is None else self.rope_keys.index(key))
            if ops_of_layer is None:
                return None
            program += ops_of_layer
        dtype = self.attention_layers[0].k_cache.dtype
        final, final_mode = self.norm.kernel_weight()
        try:
            return layers_cpu.LayerProgram(
                program,
                self.buffer_widths(),
                [self.rotary[k].rotary_dim for k in self.rope_keys],
                dtype,
                final_norm=final,
                final_eps=self.norm.eps,
                final_mode=final_mode,
            )
        except ValueError:  # caches of different layouts, odd biases: the loop handles them
            return None


def _rope_head_dim(spec: ModelSpec, key: str) -> int:
    dims = {s.attention.head_dim for s in spec.layers if s.attention and s.attention.rope == key}
    if len(dims) != 1:
        raise ValueError(f"RoPE table {key!r} serves layers of head sizes {sorted(dims)}")
    return dims.pop()


def _row_cache(cache: torch.Tensor | None, head_dim: int) -> bool:
    """Whether a layer's cache takes the native ops: float32 or bfloat16 on the CPU, token
    rows whole."""
    return (
        cache is not None
        and cache.dtype in (torch.float32, torch.bfloat16)
        and cache.device.type == "cpu"
        and cache.stride(-1) == 1
        and cache.stride(-2) == head_dim
    )


def _groups(meta: AttentionMetadata) -> list[layers_cpu.AttentionGroup]:
    """The step's attention calls, as the loop makes them: the decodes, then the prefills."""
    groups = []
    num_decode = meta.num_decode_tokens
    if num_decode:
        groups.append(
            layers_cpu.AttentionGroup(
                0, num_decode, meta.decode_block_tables, meta.decode_seq_lens, None
            )
        )
    num_tokens = meta.slot_mapping.shape[1]
    if num_tokens > num_decode:
        groups.append(
            layers_cpu.AttentionGroup(
                num_decode,
                num_tokens - num_decode,
                meta.prefill_block_tables,
                meta.prefill_seq_lens,
                meta.prefill_query_start_loc,
            )
        )
    return groups
