"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini: the Llama block with q/k/v and gate/up fused in the
checkpoint itself, partial rotary (Phi-4-mini: the first 3/4 of each head) and LongRoPE
(Phi-3.5/4-mini: the long factors for sequences longer than original_max_position_embeddings,
as transformers switches them; layers/rotary.py)."""

from __future__ import annotations

from pagecli.loader.gguf_config import get, tensor_values
from pagecli.models.base import GGUFArch
from pagecli.models.blocks import DecoderModel, ModelSpec
from pagecli.models.llama import llama_layers


def _fix_gguf_config(reader, arch: str, values: dict) -> None:
    """What transformers' GGUF map misses of Phi-3 (llama.cpp's keys): the rotary width
    (partial rotary), the LongRoPE factors (tensors rope_factors_long/short) with the
    original context and the attention factor, and the sliding window."""
    heads = values["num_attention_heads"]
    head_size = values.get("head_dim") or values["hidden_size"] // heads
    rotary = get(reader, f"{arch}.rope.dimension_count")
    rope = {"rope_type": "default", "rope_theta": float(values.pop("rope_theta", 10000.0))}
    if rotary is not None and int(rotary) != head_size:
        rope["partial_rotary_factor"] = int(rotary) / head_size
    long = tensor_values(reader, "rope_factors_long.weight")
    short = tensor_values(reader, "rope_factors_short.weight")
    if long is not None and short is not None:
        original = get(reader, f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ValueError(
                f"LongRoPE factors without {arch}.rope.scaling.original_context_length"
            )
        rope.update(rope_type="longrope", long_factor=long, short_factor=short)
        rope["original_max_position_embeddings"] = int(original)
        factor = get(reader, f"{arch}.rope.scaling.attn_factor")
        if factor is not None:
            rope["attention_factor"] = float(factor)
        values["original_max_position_embeddings"] = int(original)
    values["rope_parameters"] = rope
    window = get(reader, f"{arch}.attention.sliding_window")
    values["sliding_window"] = None if not window else int(window)


class Phi3ForCausalLM(DecoderModel):
    """Phi-3/3.5/4 and Phi-4-mini."""

    hf_architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)
    gguf = (
        GGUFArch(
            "phi3",
            "Phi3ForCausalLM",
            # llama.cpp keeps the checkpoint's fusing: attn_qkv = [q; k; v], ffn_up = [gate; up]
            layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
            global_names={"rope_factors_long": "", "rope_factors_short": ""},
            fix_config=_fix_gguf_config,
        ),
    )

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        return ModelSpec.of(
            config,
            llama_layers(config),
        )
