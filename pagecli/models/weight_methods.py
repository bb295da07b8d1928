"""How a model's weights arrive and what format each layer computes in, for any family.

The checkpoint's tensors carry transformers' names; `resolve` finds where each lands: a
parameter, or one or more parts of a fused projection (the model's `packed_modules`: q/k/v in
`qkv_proj`, gate/up in `gate_up_proj`; a checkpoint that fused them already, as Phi-3's, fills
every part at once). From the weight plan (loader/weight_plan.py) each linear gets its method:
GGUF blocks kept as they are (`use_quantized`, before loading, on the meta model), float32
rows for the native kernels or oneDNN-packed weights (`prepare_float32`), bfloat16 rows
(`prepare_bfloat16`). The families' files hold none of this.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagecli.layers.linear import BF16Linear, PackedLinear, pack_linears, use_bf16_rows
from pagecli.layers.quant_linear import QuantEmbedding, QuantLinear
from pagecli.models.base import WHOLE, CausalLM, Split
from pagecli_kernels import host_memory, quant_cpu
from pagecli_kernels.quant_formats import F32, QuantWeight, float_rows


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor lands: `owner` (a module path) and its child or
    parameter `child`; for a fused projection the parts [first, first + count) it fills
    (None: a whole parameter)."""

    owner: str
    child: str
    leaf: str  # "weight" or "bias" (of the child module); "" when child is a parameter
    first: int | None = None
    count: int = 1

    @property
    def path(self) -> str:
        return f"{self.owner}.{self.child}" if self.owner else self.child


def resolve(model: CausalLM, name: str) -> Target | None:
    """Where checkpoint tensor `name` (transformers' name) lands in `model`, or None."""
    name = name.removeprefix("model.")
    path, _, leaf = name.rpartition(".")
    owner_path, _, child = path.rpartition(".")
    try:
        owner = model.get_submodule(owner_path) if owner_path else model
    except AttributeError:
        owner = None
    if owner is not None:
        sizes = getattr(owner, "part_sizes", {})
        for fused, members in model.packed_modules.items():
            if child in members and fused in sizes:
                return Target(owner_path, fused, leaf, members.index(child), 1)
            if child == fused and fused in sizes:
                return Target(owner_path, fused, leaf, 0, len(sizes[fused]))
        module = getattr(owner, child, None)
        if isinstance(module, nn.Module) and leaf in ("weight", "bias"):
            return Target(owner_path, child, leaf)
    # a parameter of a block itself ("layers.0.self_attn.sinks")
    try:
        block = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    if isinstance(getattr(block, leaf, None), nn.Parameter):
        return Target(path, leaf, "")
    return None


def split_of(model: CausalLM, name: str) -> tuple[Split, Target] | None:
    """How tensor parallelism cuts checkpoint tensor `name`: the split its layer declares
    (`tp_splits()` of the owning module; whole by default) and where it lands."""
    target = resolve(model, name)
    if target is None:
        return None
    owner = model.get_submodule(target.owner) if target.owner else model
    splits = owner.tp_splits() if hasattr(owner, "tp_splits") else {}
    return splits.get(target.child, WHOLE), target


def part_sizes(model: CausalLM, target: Target) -> list[int]:
    """The output rows of each part of a fused projection (whole: its one size)."""
    owner = model.get_submodule(target.owner) if target.owner else model
    sizes = getattr(owner, "part_sizes", {})
    if target.child in sizes:
        return list(sizes[target.child])
    module = getattr(owner, target.child)
    return [module.out_features]


EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _check_expert(model: CausalLM, name: str) -> None:
    """A tensor of an expert the layer does not have: ValueError saying how many the config
    gives it (a config and tensors that disagree on the expert count)."""
    found = EXPERT.search(name)
    if found is None:
        return
    layer, expert = int(found[1]), int(found[2])
    try:
        mlp = model.get_submodule(f"layers.{layer}.mlp")
    except AttributeError:
        return
    experts = getattr(mlp, "experts", None)
    have = 0 if experts is None else len(experts)
    if expert >= have:
        raise ValueError(
            f"checkpoint tensor {name} is of expert {expert}, but the config gives layer "
            f"{layer} {have} experts (its expert count and the tensors disagree)"
        )


def use_quantized(model: CausalLM, names: set[str]) -> None:
    """Give the checkpoint tensors `names` (transformers' names) that arrive as `QuantWeight`s
    quantized layers; call on the meta-device model, before loading."""
    for name in names:
        short = name.removeprefix("model.")
        if short == "embed_tokens.weight":
            old = model.embed_tokens
            model.embed_tokens = QuantEmbedding(old.num_embeddings, old.embedding_dim)
            continue
        if short == "lm_head.weight" and model.lm_head is None:
            continue
        target = resolve(model, short)
        if target is None or target.leaf != "weight":
            _check_expert(model, short)
            raise ValueError(f"checkpoint tensor {name} is not a linear weight")
        owner = model.get_submodule(target.owner) if target.owner else model
        old = getattr(owner, target.child)
        if isinstance(old, QuantLinear):
            continue
        if not isinstance(old, nn.Linear):
            raise ValueError(f"checkpoint tensor {name} is not a linear weight")
        sizes = part_sizes(model, target)
        setattr(owner, target.child, QuantLinear(old.in_features, sizes, old.bias is not None))


def load_weights(
    model: CausalLM, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]
) -> None:
    """Copy checkpoint tensors (transformers' names) into the parameters, fusing q/k/v and
    gate/up; block-format weights go to their quantized layers as they are. Raises
    ValueError for a missing, unexpected or misshapen tensor."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        short = name.removeprefix("model.")
        if "rotary_emb" in short:
            continue
        if short == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding serves as the output projection
        if short == "embed_tokens.weight" and isinstance(model.embed_tokens, QuantEmbedding):
            model.embed_tokens.set_weight(tensor)
            continue
        target = resolve(model, short)
        if target is None:
            _check_expert(model, short)
            raise ValueError(f"unexpected checkpoint tensor {name}")
        if target.first is None:
            key = short if target.leaf else target.path
            param = params.get(key)
            if param is None and _load_single_part(model, target, tensor, name):
                loaded.add(f"{target.path}#0")
                continue
            if param is None:
                raise ValueError(f"unexpected checkpoint tensor {name}")
            _copy(param.data, tensor, name)
            loaded.add(key)
            continue
        sizes = part_sizes(model, target)
        covered = sizes[target.first : target.first + target.count]
        if tensor.shape[0] != sum(covered):
            raise ValueError(f"tensor {name} has {tensor.shape[0]} rows, expected {sum(covered)}")
        start = sum(sizes[: target.first])
        row = 0
        for i, size in enumerate(covered):
            index = target.first + i
            piece = _rows(tensor, row, size)
            row += size
            module = model.get_submodule(target.path)
            if isinstance(module, QuantLinear) and target.leaf == "weight":
                try:
                    module.set_part(index, piece)
                except ValueError as exc:
                    raise ValueError(f"tensor {name}: {exc}") from None
            else:
                param = params.get(f"{target.path}.{target.leaf}")
                if param is None:
                    raise ValueError(f"unexpected checkpoint tensor {name}")
                _copy(param.data.narrow(0, start + sum(covered[:i]), size), piece, name)
            loaded.add(f"{target.path}.{target.leaf}#{index}")
    missing = []
    fused = set(model.packed_modules)
    for pname in params:
        owner_path = pname.rpartition(".")[0]
        module_name = owner_path.rpartition(".")[2]
        if module_name in fused:
            target = resolve(model, pname)
            count = len(part_sizes(model, target)) if target is not None else 1
            missing += [f"{pname}#{i}" for i in range(count) if f"{pname}#{i}" not in loaded]
        elif pname not in loaded:
            missing.append(pname)
    for mname, module in model.named_modules():
        if isinstance(module, QuantLinear) and not all(module.loaded):
            missing.append(f"{mname}.weight")
        elif isinstance(module, QuantEmbedding) and module.weight is None:
            missing.append(f"{mname}.weight")
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


def _load_single_part(model: CausalLM, target: Target, tensor, name: str) -> bool:
    """Load a whole-module weight into its quantized layer if it has one."""
    if target.leaf != "weight":
        return False
    module = model.get_submodule(target.path)
    if not isinstance(module, QuantLinear):
        return False
    try:
        module.set_part(0, tensor)
    except ValueError as exc:
        raise ValueError(f"tensor {name}: {exc}") from None
    return True


def _rows(tensor, start: int, count: int):
    """Rows [start, start + count) of a float tensor or a QuantWeight (a view)."""
    if isinstance(tensor, QuantWeight):
        if start == 0 and count == tensor.rows:
            return tensor
        return QuantWeight(tensor.format, tensor.data[start : start + count], tensor.cols)
    return tensor[start : start + count]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if isinstance(src, QuantWeight):
        raise ValueError(f"tensor {name} arrives in a block format its layer cannot take")
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def prepare_float32(model: CausalLM) -> int:
    """Prepare float32 projections for the CPU, once after loading.

    With the native kernels, each projection becomes a `QuantLinear` over its own float32
    rows (quant_formats.F32): the decode kernels of the GGUF formats, and the one-call
    layer program. A tied output projection multiplies with the embedding's rows in place,
    no copy. Without them, the weights are packed for oneDNN (layers/linear.py), and a tied
    output projection gets a packed copy.

    A weight whose every value is a bfloat16 value (a bfloat16 checkpoint's, widened at
    load) keeps bfloat16 rows instead (quant_formats.BF16), and so does the embedding (a
    `QuantEmbedding`; a tied output projection reads it): their kernels widen each weight
    exactly and sum in the float32 kernels' order, so the products have the same bits from
    half the bytes. Returns the bytes that saves."""
    native = quant_cpu.library() is not None
    saved = 0
    hidden = model.embed_tokens.embedding_dim
    embed = model.embed_tokens
    table = embed.weight if isinstance(embed, nn.Embedding) else None
    whole = hidden % F32.block_values == 0
    if native and whole and table is not None and table.dtype == torch.float32:
        if _bfloat16_values(table.data):
            rows = float_rows(host_memory.copy(table.data, torch.bfloat16))  # exact
            model.embed_tokens = QuantEmbedding(*table.shape, dtype=torch.float32)
            model.embed_tokens.set_weight(rows)
            saved += table.numel() * 2
        elif model.lm_head is None:
            table.data = host_memory.copy(table.data)  # streamed every step: huge pages
            model.float_head = quant_cpu.PreparedLinear(float_rows(table.data))
    elif model.lm_head is None and table is not None:
        model.packed_head = PackedLinear(table, None)
    if native:
        saved += _float_rows_linears(model)
    pack_linears(model)
    return saved


def _bfloat16_values(t: torch.Tensor) -> bool:
    """Whether every value of the float32 tensor `t` is a bfloat16 value: the low 16 bits of
    each are zero (counted over the low halves in place, no temporary)."""
    low = t.contiguous().view(torch.int16).view(-1, 2)[:, 0 if sys.byteorder == "little" else 1]
    return not torch.count_nonzero(low)


def prepare_bfloat16(model: CausalLM) -> None:
    """Prepare bfloat16 projections for the CPU with the native kernels, once after
    loading: each becomes a `BF16Linear` (decode-sized products on the row kernels, larger
    ones on torch's GEMM), and a tied output projection reads the embedding's rows the
    same way, in place."""
    use_bf16_rows(model)  # an untied head included
    embed = model.embed_tokens
    table = embed.weight if isinstance(embed, nn.Embedding) else None
    if (
        model.lm_head is None
        and table is not None
        and table.dtype == torch.bfloat16
        and table.shape[1] % 32 == 0
    ):
        table.data = host_memory.copy(table.data)  # streamed every step: huge pages
        model.bf16_head = float_rows(table.data)


def _float_rows_linears(module: nn.Module) -> int:
    """Replace every float32 `nn.Linear` below `module` (columns whole 32-value blocks) by a
    `QuantLinear` over its rows in the F32 format (BF16 where every value is a bfloat16
    value), with its bias if it has one; the bytes the BF16 rows save."""
    saved = 0
    for name, child in list(module.named_children()):
        if (
            type(child) is nn.Linear
            and child.weight.dtype == torch.float32
            and child.in_features % F32.block_values == 0
        ):
            bias = child.bias is not None
            layer = QuantLinear(child.in_features, [child.out_features], bias=bias)
            weight = child.weight.data.contiguous()
            if _bfloat16_values(weight):  # the same products from half the bytes
                weight = host_memory.copy(weight, torch.bfloat16)  # exact
                saved += weight.numel() * 2
            layer.set_part(0, float_rows(weight))
            if bias:
                layer.bias.data.copy_(child.bias.data)
            setattr(module, name, layer)
        else:
            saved += _float_rows_linears(child)
    return saved


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LINEAR_ATTENTION = ("in_proj", "out_proj")  # Gated DeltaNet's, where a model has them


def weight_formats(model: CausalLM) -> dict[str, list[str]]:
    """Each layer type's weight formats, e.g. {"qkv_proj": ["q4_1"], "embed_tokens":
    ["q8_0"], "lm_head": ["tied"]} (float layers report their dtype)."""

    def formats(module: nn.Module) -> list[str]:
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            return module.formats
        if isinstance(module, PackedLinear):
            return ["float32 (packed)"]
        if isinstance(module, BF16Linear):
            return ["bfloat16"]
        return [str(module.weight.dtype).removeprefix("torch.")]

    found: dict[str, list[str]] = {"embed_tokens": formats(model.embed_tokens)}
    for key in PROJECTIONS + LINEAR_ATTENTION:
        modules = [m for name, m in model.named_modules() if name.rpartition(".")[2] == key]
        if modules or key in PROJECTIONS:
            found[key] = sorted({f for m in modules for f in formats(m)})
    found["lm_head"] = ["tied"] if model.lm_head is None else formats(model.lm_head)
    return found


PROJECTION_TYPES = (nn.Linear, QuantLinear, PackedLinear, BF16Linear)


def _module_bytes(module: nn.Module) -> int:
    """Bytes of a projection's (or an embedding's) weight as held: blocks, float rows,
    oneDNN-packed float32."""
    if isinstance(module, (QuantLinear, QuantEmbedding)):
        return module.nbytes
    if isinstance(module, PackedLinear):
        return module.in_features * module.out_features * 4
    weight = getattr(module, "weight", None)
    return 0 if weight is None else weight.numel() * weight.element_size()


def decode_bytes(model: CausalLM) -> tuple[int, int]:
    """(the weights' bytes, the bytes one decode token reads of them): every projection, each
    expert of a mixture of experts at its share (top_k / experts: only the chosen experts'
    rows are read), one embedding row, and the output projection (the whole embedding table
    when tied). Norms and biases are left out (a few KB)."""
    from pagecli.layers.moe import SparseMoE

    shares: dict[int, float] = {}
    for module in model.modules():
        if isinstance(module, SparseMoE):
            share = module.spec.top_k / module.spec.num_experts
            for part in module.experts.modules():
                shares[id(part)] = share
    total = active = 0.0
    for module in model.modules():
        if isinstance(module, PROJECTION_TYPES):
            size = _module_bytes(module)
            total += size
            active += size * shares.get(id(module), 1.0)
    embed = model.embed_tokens
    table = _module_bytes(embed)
    total += table
    active += table / embed.num_embeddings  # one row looked up
    if model.lm_head is None and getattr(model, "packed_head", None) is None:
        active += table  # tied: the table is the output projection too (else its packed copy)
    return int(total), int(active)
