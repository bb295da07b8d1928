"""gpt-oss (20b, 120b): pre-norm blocks of attention with q/k/v/o biases and per-head sinks,
a window of 128 on every other layer (`layer_types`), YaRN RoPE, and a sparse MoE in every
layer (layers/moe.py): the top k of the router's biased logits, softmaxed over those k,
experts with biases and the clamped SwiGLU.

From safetensors: transformers' layout, the router as `mlp.router` and each layer's experts
stacked in four tensors (`experts.gate_up_proj` [E, H, 2I] with gate and up interleaved by
columns, `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]), cut
here into each expert's gate, up and down projections (`split_tensor`); OpenAI's released
checkpoints hold the two weight stacks in MXFP4 (`*_blocks`, `*_scales`), repacked into GGUF's
MXFP4 blocks as they are read (`mxfp4_experts`: exact). From GGUF files
(`gpt-oss`, as llama.cpp's converter writes them): gate and up already apart in the 3-D
expert stacks (MXFP4 blocks in the released files), read as each expert's rows of the map,
the expert biases as [E, I] stacks, the sinks, and the YaRN keys.
"""

from __future__ import annotations

import dataclasses

import torch

from pagecli.layers.moe import MoESpec
from pagecli.loader.gguf_config import get, require
from pagecli.models.base import GGUF_EXPERT_NAMES, GGUF_ROUTER_NAMES, GGUFArch
from pagecli.models.blocks import DecoderModel, ModelSpec
from pagecli.models.llama import llama_layers
from pagecli.models.qwen3_moe import gguf_moe_values
from pagecli_kernels.quant_formats import FORMATS, QuantWeight

Weight = QuantWeight | torch.Tensor

STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias")
STACKED += ("mlp.experts.down_proj", "mlp.experts.down_proj_bias")
# the released checkpoints' experts: MXFP4 blocks [E, rows, cols / 32, 16] (value 2j the low
# nibble of byte j, 2j + 1 the high one) and their E8M0 scales [E, rows, cols / 32]
MXFP4_STACKS = ("mlp.experts.gate_up_proj_blocks", "mlp.experts.gate_up_proj_scales")
MXFP4_STACKS += ("mlp.experts.down_proj_blocks", "mlp.experts.down_proj_scales")


def mxfp4_experts(
    stem: str, kind: str, blocks: torch.Tensor, scales: torch.Tensor
) -> list[tuple[str, QuantWeight]]:
    """A layer's MXFP4 expert stack (transformers' layout) as each expert's projections in
    GGUF's MXFP4 blocks, exactly (the same FP4 codes and E8M0 exponents: ggml's block is the
    exponent, then value j in the low nibble of byte j and j + 16 in the high one); the rows
    of gate_up alternate gate and up."""
    experts, rows, groups, _ = blocks.shape
    if blocks.device.type == "meta":  # the shapes alone
        data = torch.empty(experts, rows, groups * 17, dtype=torch.uint8, device="meta")
    else:
        codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(
            experts, rows, groups, 32
        )  # each block's 32 codes in order
        qs = codes[..., :16] | (codes[..., 16:] << 4)
        data = torch.cat([scales.unsqueeze(-1), qs], dim=-1).reshape(experts, rows, -1)
    fmt, cols = FORMATS["mxfp4"], groups * 32
    out = []
    for e in range(experts):
        if kind == "gate_up_proj":
            out.append(
                (f"{stem}.{e}.gate_proj.weight", QuantWeight(fmt, data[e, 0::2].contiguous(), cols))
            )
            out.append(
                (f"{stem}.{e}.up_proj.weight", QuantWeight(fmt, data[e, 1::2].contiguous(), cols))
            )
        else:
            out.append(
                (f"{stem}.{e}.down_proj.weight", QuantWeight(fmt, data[e].contiguous(), cols))
            )
    return out


def _gguf_config(reader, arch: str) -> dict:
    """transformers' GptOssConfig from llama.cpp's keys: the experts', the window (every
    other layer from the first, as llama.cpp's graph and transformers' default place it),
    YaRN's factor, original context and betas (32 and 1 where the file has none: both
    readers' defaults), without truncation (transformers' gpt-oss config)."""
    values = gguf_moe_values(reader, arch, "gpt_oss")
    values["num_local_experts"] = values.pop("num_experts")
    values["intermediate_size"] = values.pop("moe_intermediate_size", None) or values.get(
        "intermediate_size"
    )
    window = int(require(reader, f"{arch}.attention.sliding_window"))
    values["sliding_window"] = window
    layers = values["num_hidden_layers"]
    values["layer_types"] = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    values["attention_bias"] = True
    rope = {"rope_type": "default", "rope_theta": values.pop("rope_theta", 150000.0)}
    if get(reader, f"{arch}.rope.scaling.type") == "yarn":
        rope |= {
            "rope_type": "yarn",
            "factor": float(require(reader, f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(
                require(reader, f"{arch}.rope.scaling.original_context_length")
            ),
            "beta_fast": float(get(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }
    values["rope_parameters"] = rope
    values["tie_word_embeddings"] = False
    return values


def _to_transformers(tensors: dict[str, torch.Tensor], values: dict) -> None:
    """The per-expert tensors read from a GGUF file as transformers' gpt-oss stacks them
    (the inverse of `GptOssForCausalLM.split_tensor`), the router as `mlp.router`."""
    experts = int(values["num_local_experts"])
    for layer in range(int(values["num_hidden_layers"])):
        stem = f"model.layers.{layer}.mlp"
        for leaf in ("weight", "bias"):
            tensors[f"{stem}.router.{leaf}"] = tensors.pop(f"{stem}.gate.{leaf}")

        def take(kind: str, leaf: str, stem: str = stem) -> torch.Tensor:
            return torch.stack(
                [tensors.pop(f"{stem}.experts.{e}.{kind}.{leaf}") for e in range(experts)]
            )

        gate, up = take("gate_proj", "weight"), take("up_proj", "weight")  # [E, I, H]
        tensors[f"{stem}.experts.gate_up_proj"] = (
            torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2).contiguous()
        )  # [E, H, 2I], gate and up alternating
        gate, up = take("gate_proj", "bias"), take("up_proj", "bias")  # [E, I]
        tensors[f"{stem}.experts.gate_up_proj_bias"] = torch.stack([gate, up], 2).flatten(1)
        down = take("down_proj", "weight")  # [E, H, I]
        tensors[f"{stem}.experts.down_proj"] = down.transpose(1, 2).contiguous()
        tensors[f"{stem}.experts.down_proj_bias"] = take("down_proj", "bias")


GGUF_GPT_OSS = GGUFArch(
    "gpt-oss",
    "GptOssForCausalLM",
    layer_names={
        **GGUF_ROUTER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
    },
    layer_tensors={"attn_sinks.weight": "self_attn.sinks"},
    expert_names=GGUF_EXPERT_NAMES,
    to_transformers=_to_transformers,
    config=_gguf_config,
)


class GptOssForCausalLM(DecoderModel):
    """gpt-oss."""

    hf_architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    gguf = (GGUF_GPT_OSS,)
    split_names = STACKED + MXFP4_STACKS

    @classmethod
    def rename_tensor(cls, name: str) -> str:
        """The router (`mlp.router`) under the MoE's name for it, `mlp.gate`."""
        return name.replace(".mlp.router.", ".mlp.gate.")

    @classmethod
    def split_tensor(cls, name: str, tensor: torch.Tensor, held: dict) -> list[tuple[str, Weight]]:
        """A layer's stacked experts as each expert's projections (transformers' per-expert
        names): the stacks hold x @ W, so each expert's weight is its slice transposed; gate
        and up columns alternate (gate first). MXFP4 blocks wait in `held` for their scales
        (or the scales for their blocks), then become each expert's blocks (mxfp4_experts)."""
        stem, leaf = name.rsplit(".", 1)  # model.layers.{i}.mlp.experts, the stack
        if leaf.endswith(("_blocks", "_scales")):
            kind, part = leaf.rsplit("_", 1)
            waiting = held.setdefault(f"{stem}.{kind}", {})
            waiting[part] = tensor
            if len(waiting) < 2:
                return []
            del held[f"{stem}.{kind}"]
            return mxfp4_experts(stem, kind, waiting["blocks"], waiting["scales"])
        out = []
        for e in range(tensor.shape[0]):
            if leaf == "gate_up_proj":  # [E, H, 2I]
                w = tensor[e].t()  # [2I, H]
                out.append((f"{stem}.{e}.gate_proj.weight", w[0::2].contiguous()))
                out.append((f"{stem}.{e}.up_proj.weight", w[1::2].contiguous()))
            elif leaf == "gate_up_proj_bias":  # [E, 2I]
                out.append((f"{stem}.{e}.gate_proj.bias", tensor[e, 0::2].contiguous()))
                out.append((f"{stem}.{e}.up_proj.bias", tensor[e, 1::2].contiguous()))
            elif leaf == "down_proj":  # [E, I, H]
                out.append((f"{stem}.{e}.down_proj.weight", tensor[e].t().contiguous()))
            else:  # down_proj_bias [E, H]
                out.append((f"{stem}.{e}.down_proj.bias", tensor[e].contiguous()))
        return out

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        experts = int(config.num_local_experts)
        top_k = int(config.num_experts_per_tok)
        if not 1 <= top_k <= experts:
            raise ValueError(f"{top_k} experts per token of {experts}")
        moe = MoESpec(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=config.intermediate_size,
            activation="swiglu_oai",
            routing="topk_softmax",
            router_bias=True,
            expert_bias=True,
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(config.swiglu_limit),
        )
        layers = tuple(
            dataclasses.replace(
                layer,
                attention=dataclasses.replace(
                    layer.attention, qkv_bias=True, o_bias=True, sinks=True
                ),
                mlp=moe,
            )
            for layer in llama_layers(config)
        )
        return ModelSpec.of(
            config,
            layers,
        )
