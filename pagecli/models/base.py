"""The model contract: what a family's model gives the engine and the loader.

A family is one file under pagecli/models/ with one `CausalLM` subclass (most build on
`blocks.DecoderModel`) and one line in registry.py. The engine and the loader read only what
this module names:

- `forward(input_ids, positions, meta)` and `compute_logits(hidden)`: one flat step over the
  paged KV cache (engine/model_runner.py);
- `kv_layout()`: each layer's KV heads, head size, kind (full or sliding window) and sinks,
  from which the runner sizes and lays out the cache;
- `attention_layers`: the `PagedAttention` of each layer, in order, whose caches the runner
  sets; `state_layers`: the layers that keep a state per sequence instead (Gated DeltaNet),
  whose state slots the runner sets;
- the class attributes: the transformers architectures and model types it serves
  (`hf_architectures`, `model_types`), the GGUF architectures it reads (`gguf`), and how its
  checkpoint's tensors land in its modules (`packed_modules`);
- `tp_splits()` on its modules: how tensor parallelism cuts each weight (layers/parallel.py);
- `layer_program()`: its decoder layers as a list of native ops for the CPU's one-call path.

docs/models.md walks through adding a family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch import nn

if TYPE_CHECKING:
    from pagecli.layers.attention import AttentionMetadata, PagedAttention
    from pagecli.loader.gguf_file import GGUFFile

LayerKind = Literal["full", "sliding_window"]


@dataclass(frozen=True)
class KVLayout:
    """One attention layer's KV cache: `num_kv_heads` heads of `head_dim` values per token;
    a sliding-window layer's queries see only the last `window` positions; `sinks`: the
    layer has per-head attention sinks (they add nothing to the cache)."""

    num_kv_heads: int
    head_dim: int
    kind: LayerKind = "full"
    window: int | None = None
    sinks: bool = False


# llama.cpp's tensor names -> transformers' (per layer "blk.N.<x>" -> "model.layers.N.<y>"),
# the layout most architectures share; a family's GGUFArch overrides or adds entries.
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# llama.cpp's MoE tensors: the router, and the 3-D expert stacks -> each expert's
# transformers name ("{e}": the expert's index)
GGUF_ROUTER_NAMES = {"ffn_gate_inp": "mlp.gate"}
GGUF_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF architecture (`general.architecture`) is read.

    `hf_architecture`: the transformers class name its config gets. `layer_names` and
    `global_names`: llama.cpp tensor names (without `.weight`/`.bias`) -> transformers names,
    over the shared defaults. `qk_permuted`: llama.cpp's converter interleaved each head's
    rotary halves in the Q/K rows (its NORM-rope archs). `norm_offset`: norm weights are
    stored as 1 + w (Gemma; transformers subtracts 1 on reading). `layer_tensors`: whole
    per-layer names, suffix included or absent ("ssm_a", "ssm_dt.bias") -> transformers' leaf
    names ("linear_attn.A_log"), for tensors the stem map cannot name. `convert`: the
    arch's stored conventions undone on a float tensor (transformers' name, tensor) -> tensor,
    as transformers' GGUF reader undoes them (Qwen3.5's A_log = log(-A)); block-format
    weights are never passed to it. `to_transformers`: (float weights by name, config values)
    -> rearranges in place what pagecli keeps in the file's order into transformers' order
    (Qwen3.5's tiled value heads), for the float32 checkpoint written for transformers.
    `expert_names`: llama.cpp's 3-D expert stacks ("ffn_gate_exps") -> each expert's
    transformers name ("mlp.experts.{e}.gate_proj"), read as row ranges of the stack.
    `config`: pagecli's own map from the file's metadata to the transformers config's
    values, for archs whose GGUF transformers cannot read (None: transformers'
    GGUF_CONFIG_MAPPING); `fix_config` amends transformers' map where it misses keys."""

    name: str
    hf_architecture: str
    layer_names: dict[str, str] = field(default_factory=dict)
    global_names: dict[str, str] = field(default_factory=dict)
    qk_permuted: bool = False
    norm_offset: bool = False
    layer_tensors: dict[str, str] = field(default_factory=dict)
    expert_names: dict[str, str] = field(default_factory=dict)
    convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    to_transformers: Callable[[dict[str, torch.Tensor], dict], None] | None = None
    config: Callable[[GGUFFile, str], dict] | None = None
    fix_config: Callable[[GGUFFile, str, dict], None] | None = None

    def expert_template(self, gguf_name: str) -> str | None:
        """For a 3-D expert stack ("blk.3.ffn_up_exps.weight") or a 2-D stack of the experts'
        biases (gpt-oss's "blk.3.ffn_up_exps.bias"): its experts' transformers name with "{e}"
        for the expert ("model.layers.3.mlp.experts.{e}.up_proj.weight"); None for any other
        tensor."""
        parts = gguf_name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
            return None
        target = self.expert_names.get(parts[2])
        if target is None or parts[3] not in ("weight", "bias"):
            return None
        return f"model.layers.{parts[1]}.{target}.{parts[3]}"

    def hf_name(self, gguf_name: str) -> str | None:
        """The transformers name of a tensor of this arch, or None (no counterpart)."""
        parts = gguf_name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            whole = self.layer_tensors.get(parts[2])
            if whole is not None:
                return f"model.layers.{parts[1]}.{whole}"
        stem, dot, suffix = gguf_name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            return None
        global_names = {**GGUF_GLOBAL_NAMES, **self.global_names}
        if stem in global_names:  # "": a tensor the config carries (Phi-3's rope factors)
            return f"{global_names[stem]}.{suffix}" if global_names[stem] else None
        parts = stem.split(".")
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
            return None
        layer_names = {**GGUF_LAYER_NAMES, **self.layer_names}
        target = layer_names.get(parts[2])
        if target is None:
            return None
        return f"model.layers.{parts[1]}.{target}.{suffix}"


@dataclass(frozen=True)
class Split:
    """How tensor parallelism cuts a weight (layers/parallel.py reads these).

    kind "column": by output rows, in `segments` (axis, unit) stacked by rows: e.g. q, k, v
    as ("q_heads", head_dim), ("kv_heads", head_dim), ("kv_heads", head_dim): each segment
    keeps the rank's range of its axis, times unit rows. "row": by input columns, one
    segment; its bias is added by rank 0 only. "vocab": by vocabulary rows. "whole": every
    rank holds all of it. `reason` (kind "none"): the weight cannot be split, and why."""

    kind: Literal["column", "row", "vocab", "whole", "none"]
    segments: tuple[tuple[str, int], ...] = ()
    reason: str = ""


WHOLE = Split("whole")


class CausalLM(nn.Module):
    """A decoder-only language model over the paged KV cache (see the module docstring)."""

    hf_architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()
    gguf: ClassVar[tuple[GGUFArch, ...]] = ()
    # GGUF architectures another family reads whose files this class runs when their config
    # says so (a `llama` file with experts is Mixtral's: llama.py's fix_config)
    gguf_shared: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def rename_tensor(cls, name: str) -> str:
        """A checkpoint tensor's name as this class's modules call it (Mixtral's
        block_sparse_moe.experts.{e}.w1 -> mlp.experts.{e}.gate_proj); the name itself for
        most families."""
        return name

    # checkpoint tensors (after rename_tensor) that hold several of this class's tensors:
    # their names; split_tensor cuts them (gpt-oss's experts stacked in one tensor)
    split_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def split_tensor(cls, name: str, tensor: torch.Tensor, held: dict) -> list:
        """A checkpoint tensor as the tensors this class's modules take ((name, tensor or
        block-format QuantWeight) pairs in transformers' per-module names); itself for most.
        `held` lasts one pass over the checkpoint: a cut that needs a later tensor keeps
        this one there and returns nothing until that one comes (gpt-oss's MXFP4 blocks and
        scales). Called on meta tensors too, for the shapes alone."""
        return [(name, tensor)]

    # multimodal checkpoints whose language model this class runs: their architecture -> the
    # prefix of the language model's tensor names ("model.language_model."); the config's
    # text_config is the model's, and the rest of the checkpoint (a vision tower, a
    # multi-token-prediction head) is not read
    multimodal_architectures: ClassVar[dict[str, str]] = {}
    # fused parameter -> the checkpoint tensors stacked in it by rows, in order
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    # LongRoPE: the original context past which transformers rotates with the long factors
    # (the runner marks those tokens: AttentionMetadata.long_rope_rows); None otherwise
    long_rope_from: int | None = None

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError naming what this class cannot run in `config` (before loading)."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> the last hidden states [T, H]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] -> float32 logits [S, V] (under tensor parallelism this rank's columns)."""
        raise NotImplementedError

    def kv_layout(self) -> list[KVLayout]:
        """Each attention layer's KV cache, in layer order."""
        raise NotImplementedError

    @property
    def attention_layers(self) -> list[PagedAttention]:
        """Each layer's paged attention, in the order of `kv_layout()`."""
        raise NotImplementedError

    @property
    def moe_layers(self) -> list[nn.Module]:
        """The layers' sparse mixture-of-experts MLPs (each with an `impl` the runner sets,
        as the attention's), in order."""
        return []

    @property
    def state_layers(self) -> list[nn.Module]:
        """The layers that keep a fixed-size state per sequence instead of a KV cache (each
        with `spec.state_bytes(dtype)` and the `slots`, `snapshots` and `host` StateStores
        the runner sets), in order."""
        return []

    def post_load(self) -> None:
        """Derive what the loaded weights imply (e.g. Gemma's 1 + w norms), once after
        loading; every module's own `post_load` runs."""
        for module in self.modules():
            if module is not self and hasattr(module, "post_load"):
                module.post_load()
