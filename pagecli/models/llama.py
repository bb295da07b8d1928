"""The Llama family, implemented once: Llama 2/3 (llama3 RoPE scaling), Mistral, Qwen2 (q/k/v
bias), Qwen3 (q/k RMSNorm), SmolLM; GQA/MQA and tied embeddings.

The model works on a flattened batch: `input_ids` and `positions` are `[T]` for all the new
tokens of all sequences in the step; attention reads and writes the paged KV cache. Parameter
names follow transformers' checkpoints, except that q/k/v and gate/up are fused at load time.
Weights kept in a GGUF block format (`QuantWeight`) get quantized layers (layers/quant_linear.py)
through `use_quantized`, before loading.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagecli.layers.attention import AttentionMetadata, PagedAttention
from pagecli.layers.linear import BF16Linear, PackedLinear, pack_linears, use_bf16_rows
from pagecli.layers.norm import RMSNorm
from pagecli.layers.parallel import TensorParallel
from pagecli.layers.quant_linear import QuantEmbedding, QuantLinear
from pagecli.layers.rotary import RotaryEmbedding, apply_rotary
from pagecli_kernels import fused_cpu, host_memory, layers_cpu, quant_cpu
from pagecli_kernels.quant_formats import F32, QuantWeight, float_rows

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) for the step's positions


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        model_type = config.model_type
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, o_bias)
        self.q_norm = self.k_norm = None
        if model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )
        # q/k weight rows in llama.cpp's order (each head's rotary halves interleaved, as a
        # GGUF file keeps them in place): the rotary reads each head's pairs back into halves
        self.qk_pairs = False
        # tensor parallelism: this rank's heads only; o_proj's partial sums are all-reduced
        self.tp: TensorParallel | None = None

    def forward(self, rope: Rope, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope, pairs=self.qk_pairs)
        out = self.attn(q, k, v.contiguous(), meta)  # [T, Hq, D]
        out = self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, H]
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        self.tp: TensorParallel | None = None  # this rank's columns; down_proj all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if fused_cpu.available(gate_up) and gate_up.stride(-1) == 1:
            out = self.down_proj(fused_cpu.silu_mul(gate_up))  # one native call on the CPU
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            out = self.down_proj(F.silu(gate) * up)  # [T, H]
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: Rope, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # The residual additions mirror transformers' order so float32 results agree closely.
        # hidden is this step's own tensor: the first residual add goes in place, fused with
        # the norm that follows it.
        attn_out = self.self_attn(rope, self.input_layernorm(hidden), meta)  # [T, H]
        normed = self.post_attention_layernorm.add_forward(hidden, attn_out)  # hidden += attn
        return hidden + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over the paged KV cache.

    With `tp` (tensor parallelism), `config` is this rank's (loader/shards.py: its heads and
    MLP width) and the module holds its shard: the embedding and the output projection hold
    its vocabulary rows, and compute_logits returns only those columns."""

    # checkpoint name fragment -> (fused parameter fragment, shard index)
    _fused = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, config, max_position: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        vocab_rows = config.vocab_size if tp is None else tp.shard.vocab[1] - tp.shard.vocab[0]
        # _weight: no reset_parameters (its normal_ imports torch._dynamo and triton, 1 s and
        # 130 MB at start-up); the loader or init_dummy_weights sets every weight anyway
        self.embed_tokens = nn.Embedding(
            vocab_rows,
            config.hidden_size,
            _weight=torch.empty(vocab_rows, config.hidden_size),
        )
        self.rotary = RotaryEmbedding(config, _head_dim(config), max_position)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        for layer in self.layers:
            layer.self_attn.tp = layer.mlp.tp = tp
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        self.packed_head: PackedLinear | None = None  # set by pack_weights()
        # the tied output projection over the embedding's own float32 rows (native kernels)
        self.float_head: quant_cpu.PreparedLinear | None = None  # set by pack_weights()
        # the embedding's bfloat16 rows for quant_cpu.bf16_linear (set by use_bf16_rows())
        self.bf16_head: QuantWeight | None = None
        # the decoder layers bound for one native call (CPU, quantized), rebuilt when the
        # caches or attention implementations change; see native_layers()
        self._native: tuple[list, layers_cpu.DecoderLayers | None] = ([], None)
        self._attention: list[PagedAttention] | None = None  # attention_layers, kept

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.tp is None:
            hidden = self.embed_tokens(input_ids)  # [T, H]
        else:
            hidden = self.tp.embed(self.embed_tokens, input_ids)  # [T, H]
        rope = self.rotary(positions)  # (cos, sin), [T, 1, D] each
        native = self.native_layers(hidden, rope)
        if native is not None:  # the same kernels as the loop below, in one call
            cos, sin = rope[0][:, 0], rope[1][:, 0]
            shm = self.tp.shm if self.tp is not None else None
            normed = native(hidden, cos, sin, meta.slot_mapping, _groups(meta), shm)
            return normed if normed is not None else self.norm(hidden)  # the last norm in C too
        for layer in self.layers:
            hidden = layer(rope, hidden, meta)
        return self.norm(hidden)

    def native_layers(self, hidden: torch.Tensor, rope: Rope) -> layers_cpu.DecoderLayers | None:
        """The decoder layers bound for one native call when this step can take it: float32
        or bfloat16 activations and caches on the CPU, every projection block-format or
        float32-rows buffers (one, or a QuantLinear's parts; bfloat16: the native kernels of
        `BF16Linear`, so only for steps that `BF16Linear.native_takes`, which the loop's layers
        also give to them; biases allowed), no q/k norm, the CPU attention kernels; under
        tensor parallelism, float32 steps whose all-reduces fit the shared-memory collective
        (the C loop calls it between the layers' halves). None: the Python loop runs."""
        shm = self.tp.shm if self.tp is not None else None
        if (
            (self.tp is not None and (shm is None or not shm.takes(hidden)))
            or hidden.dtype not in (torch.float32, torch.bfloat16)
            or (hidden.dtype == torch.bfloat16 and not BF16Linear.native_takes(hidden.shape[0]))
            or hidden.device.type != "cpu"
            or not hidden.is_contiguous()
            or rope[0].dtype != hidden.dtype
            or not rope[0].is_contiguous()
            or not layers_cpu.enabled()
        ):
            return None
        if self._attention is None:  # the layers never change; their caches and impl may
            self._attention = self.attention_layers
        key = [(id(a.k_cache), id(a.v_cache), a.impl) for a in self._attention]
        if key != self._native[0]:
            self._native = (key, self._bind_native_layers())
        return self._native[1]

    def _bind_native_layers(self) -> layers_cpu.DecoderLayers | None:
        bound = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights = [_native_weight(mod) for mod in projections]
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            caches = [attn.attn.k_cache, attn.attn.v_cache]
            if (
                None in weights
                or attn.q_norm is not None
                or attn.attn.impl not in ("auto", "cpu")
                or attn.head_dim > 512
                or any(not _row_cache(c, attn.head_dim) for c in caches)
                or any(w.dtype != caches[0].dtype or not w.is_contiguous() for w in norms)
                or caches[0].stride() != caches[1].stride()
            ):
                return None
            biases = tuple(_float_bias(mod) for mod in projections)
            bound.append(
                layers_cpu.LayerWeights(*(w.data for w in norms), *weights, *caches, biases)
            )
        attn = self.layers[0].self_attn
        final = self.norm.weight.data
        final = final if final.dtype == bound[0].k_cache.dtype and final.is_contiguous() else None
        try:
            return layers_cpu.DecoderLayers(
                bound,
                num_heads=attn.num_heads,
                num_kv_heads=attn.num_kv_heads,
                head_dim=attn.head_dim,
                intermediate_size=self.layers[0].mlp.intermediate_size,
                eps=self.layers[0].input_layernorm.eps,
                scale=attn.attn.scale,
                final_norm=final,
                final_eps=self.norm.eps,
                qk_pairs=attn.qk_pairs,
            )
        except ValueError:  # caches of different layouts, odd biases: the loop handles them
            return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the selected positions: [S, H] -> [S, V] (with `tp`, this
        rank's vocabulary columns)."""
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

    def pack_weights(self) -> None:
        """Prepare float32 projections for the CPU, once after loading.

        With the native kernels, each projection becomes a `QuantLinear` over its own float32
        rows (quant_formats.F32): the decode kernels of the GGUF formats, and the one-call
        decoder layers (`native_layers`). A tied output projection multiplies with the
        embedding's rows in place, no copy. Without them, the weights are packed for oneDNN
        (layers/linear.py), and a tied output projection gets a packed copy."""
        native = quant_cpu.library() is not None
        hidden = self.config.hidden_size
        if self.lm_head is None and isinstance(self.embed_tokens, nn.Embedding):
            table = self.embed_tokens.weight
            if native and hidden % F32.block_values == 0 and table.dtype == torch.float32:
                table.data = host_memory.copy(table.data)  # streamed every step: huge pages
                self.float_head = quant_cpu.PreparedLinear(float_rows(table.data))
            else:
                self.packed_head = PackedLinear(table, None)
        if native:
            _float_rows_linears(self)
        pack_linears(self)

    def use_bf16_rows(self) -> None:
        """Prepare bfloat16 projections for the CPU with the native kernels, once after
        loading: each becomes a `BF16Linear` (decode-sized products on the row kernels, larger
        ones on torch's GEMM), and a tied output projection reads the embedding's rows the
        same way, in place."""
        use_bf16_rows(self)  # an untied head included
        table = self.embed_tokens.weight if isinstance(self.embed_tokens, nn.Embedding) else None
        if (
            self.lm_head is None
            and table is not None
            and table.dtype == torch.bfloat16
            and table.shape[1] % 32 == 0
        ):
            table.data = host_memory.copy(table.data)  # streamed every step: huge pages
            self.bf16_head = float_rows(table.data)

    def use_qk_pairs(self) -> None:
        """The checkpoint's Q/K weights (and biases) come in llama.cpp's row order, each
        head's rotary halves interleaved (a GGUF read in place): every attention layer
        deinterleaves its q and k outputs, so the rest of the model is unchanged."""
        for layer in self.layers:
            if layer.self_attn.q_norm is not None:  # it would see the interleaved order
                raise ValueError("q/k norms need the checkpoint's q/k rows unpermuted")
            layer.self_attn.qk_pairs = True
        self._native = ([], None)  # rebind the one-call layers with the flag

    def use_quantized(self, names: set[str]) -> None:
        """Give the checkpoint tensors `names` (transformers' names) that arrive as
        `QuantWeight`s quantized layers; call on the meta-device model, before loading."""
        for name in names:
            name = name.removeprefix("model.")
            if name == "embed_tokens.weight":
                old = self.embed_tokens
                self.embed_tokens = QuantEmbedding(old.num_embeddings, old.embedding_dim)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target = name
            for fragment, (fused, _) in self._fused.items():
                target = target.replace(fragment, fused)
            path = target.removesuffix(".weight")
            parent_path, _, child = path.rpartition(".")
            parent = self.get_submodule(parent_path) if parent_path else self
            old = getattr(parent, child)
            if isinstance(old, QuantLinear):
                continue
            if not isinstance(old, nn.Linear):
                raise ValueError(f"checkpoint tensor {name} is not a linear weight")
            sizes = [old.out_features]
            if ".qkv_proj." in target or ".gate_up_proj." in target:
                sizes = self._shard_sizes(target)
            setattr(parent, child, QuantLinear(old.in_features, sizes, old.bias is not None))

    @property
    def weight_formats(self) -> dict[str, list[str]]:
        """Each layer type's weight formats, e.g. {"qkv_proj": ["q4_1"], "embed_tokens":
        ["q8_0"], "lm_head": ["tied"]} (float layers report their dtype)."""

        def formats(module: nn.Module) -> list[str]:
            if isinstance(module, (QuantLinear, QuantEmbedding)):
                return module.formats
            if isinstance(module, PackedLinear):
                return ["float32 (packed)"]
            return [str(module.weight.dtype).removeprefix("torch.")]

        found: dict[str, list[str]] = {"embed_tokens": formats(self.embed_tokens)}
        for key in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            found[key] = sorted(
                {f for lay in self.layers for f in formats(_layer_module(lay, key))}
            )
        found["lm_head"] = ["tied"] if self.lm_head is None else formats(self.lm_head)
        return found

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers' names) into the parameters, fusing q/k/v and
        gate/up. Raises ValueError for a missing or misshapen tensor."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the output projection
            if self._load_quantized(name, tensor, loaded):
                continue
            for fragment, (fused, shard) in self._fused.items():
                if fragment in name:
                    target = name.replace(fragment, fused)
                    param = params.get(target)
                    if param is None:
                        raise ValueError(f"unexpected checkpoint tensor {name}")
                    start, size = self._shard_range(target, shard)
                    _copy(param.data.narrow(0, start, size), tensor, name)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                param = params.get(name)
                if param is None:
                    raise ValueError(f"unexpected checkpoint tensor {name}")
                _copy(param.data, tensor, name)
                loaded.add(name)
        missing = []
        for pname in params:
            if ".qkv_proj." in pname:
                missing += [f"{pname}#{i}" for i in range(3) if f"{pname}#{i}" not in loaded]
            elif ".gate_up_proj." in pname:
                missing += [f"{pname}#{i}" for i in range(2) if f"{pname}#{i}" not in loaded]
            elif pname not in loaded:
                missing.append(pname)
        for mname, module in self.named_modules():
            if isinstance(module, QuantLinear) and not all(module.loaded):
                missing.append(f"{mname}.weight")
            elif isinstance(module, QuantEmbedding) and module.weight is None:
                missing.append(f"{mname}.weight")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")

    def _load_quantized(self, name: str, tensor, loaded: set[str]) -> bool:
        """Load `name` into its quantized layer if it has one; False if it has not."""
        if name == "embed_tokens.weight" and isinstance(self.embed_tokens, QuantEmbedding):
            self.embed_tokens.set_weight(tensor)
            return True
        if not name.endswith(".weight"):
            return False
        target, shard = name, 0
        for fragment, (fused, index) in self._fused.items():
            if fragment in name:
                target, shard = name.replace(fragment, fused), index
                break
        try:
            module = self.get_submodule(target.removesuffix(".weight"))
        except AttributeError:
            return False
        if not isinstance(module, QuantLinear):
            return False
        try:
            module.set_part(shard, tensor)
        except ValueError as exc:
            raise ValueError(f"tensor {name}: {exc}") from None
        loaded.add(f"{target}#{shard}")
        return True

    def _shard_sizes(self, param_name: str) -> list[int]:
        if ".qkv_proj." in param_name:
            attn = self.layers[0].self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.config.intermediate_size] * 2

    def _shard_range(self, param_name: str, shard: int) -> tuple[int, int]:
        sizes = self._shard_sizes(param_name)
        return sum(sizes[:shard]), sizes[shard]


def _native_weight(module: nn.Module) -> layers_cpu.Projection | None:
    """A projection's weight as the one-call layers take it (one buffer, or a QuantLinear's
    parts); None: they cannot."""
    parts = getattr(module, "native_parts", None)
    return parts if parts is not None else getattr(module, "single_weight", None)


def _float_rows_linears(module: nn.Module) -> None:
    """Replace every float32 `nn.Linear` below `module` (columns whole 32-value blocks) by a
    `QuantLinear` over its rows in the F32 format, with its bias if it has one."""
    for name, child in list(module.named_children()):
        if (
            type(child) is nn.Linear
            and child.weight.dtype == torch.float32
            and child.in_features % F32.block_values == 0
        ):
            bias = child.bias is not None
            layer = QuantLinear(child.in_features, [child.out_features], bias=bias)
            layer.set_part(0, float_rows(child.weight.data.contiguous()))
            if bias:
                layer.bias.data.copy_(child.bias.data)
            setattr(module, name, layer)
        else:
            _float_rows_linears(child)


def _float_bias(module: nn.Module) -> torch.Tensor | None:
    """The float32 bias a projection adds to its float32 sums (None: no bias)."""
    if isinstance(module, BF16Linear):
        return module.float_bias
    return None if module.bias is None else module.bias.data


def _row_cache(cache: torch.Tensor | None, head_dim: int) -> bool:
    """Whether a layer's cache takes the native loop: float32 or bfloat16 on the CPU, token
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
    num_tokens = meta.slot_mapping.shape[0]
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


def _layer_module(layer: nn.Module, key: str) -> nn.Module:
    """A decoder layer's projection `key` (qkv_proj, o_proj, gate_up_proj, down_proj)."""
    owner = layer.self_attn if key in ("qkv_proj", "o_proj") else layer.mlp
    return getattr(owner, key)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
