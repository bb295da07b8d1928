"""What the model's weights will be in memory, decided before anything is loaded.

`plan_weights` turns `--quantization` and the source into a `WeightPlan`: the effective mode,
the checkpoint tensors that arrive as `QuantWeight`s (their layers are made quantized on the
meta model first, so no float copy is ever allocated), the bytes that will be resident (for
the memory check) and the stream of (name, weight) to load.

| source       | auto                       | none              | q8_0 / q4_k               |
| ------------ | -------------------------- | ----------------- | ------------------------- |
| GGUF         | the file's block formats   | float (dequant.)  | refused: no re-quantizing |
| safetensors  | float, as stored           | float             | quantized once, cached    |

Quantized weights need the CPU and the native kernels; on CUDA `auto` means `none` (today's
behaviour, dequantize to the compute dtype), and on a CPU without the kernels `auto` falls
back to `none` with one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagecli.loader.resolve import ModelLoadError, ModelSource
from pagecli.loader.shards import RankShard
from pagecli_kernels.quant_formats import FORMATS, QuantWeight

Weight = QuantWeight | torch.Tensor
CutOf = Callable[[str], object]  # checkpoint name -> loader/shards.py's cut of it


@dataclass(frozen=True)
class WeightPlan:
    """The weights' in-memory formats and where they come from."""

    mode: str  # "gguf" (the file's formats), "none", "q8_0" or "q4_k"
    quantized_names: set[str] = field(default_factory=set)
    resident_bytes: int | None = None  # None: parameters x dtype size
    weights: Callable[[], Iterator[tuple[str, Weight]]] | None = None  # None: dummy weights
    # of resident_bytes, those read in place from a memory-mapped file's page cache (the
    # rest is memory of the process's own)
    mapped_bytes: int = 0
    qk_pairs: bool = False  # Q/K weights in llama.cpp's row order (gguf_weights.keeps_qk_pairs)
    # block width (values) of each block-format tensor: the columns a tensor-parallel split
    # must not cut (loader/shards.py)
    block_values: dict[str, int] = field(default_factory=dict)
    # a rank's slices read straight from the files (safetensors); None: sliced after loading
    read_shard: Callable[[RankShard, CutOf], Iterator[tuple[str, Weight]]] | None = None
    # makes what weights() reads, once (the quantized cache): rank 0 calls it before it
    # starts tensor-parallel workers, so that they do not each make it
    prepare: Callable[[], object] | None = None

    def shard_weights(
        self, shard: RankShard | None, cut_of: CutOf | None = None
    ) -> Iterator[tuple[str, Weight]]:
        """The weights as a tensor-parallel rank holds them (`shard`; None: whole), each cut
        as `cut_of(name)` says (the model's splits: RankShard.cut)."""
        if shard is None:
            yield from self.weights()
            return
        if cut_of is None:
            raise ValueError("a tensor-parallel shard needs the model's cuts")
        if self.read_shard is not None:
            yield from self.read_shard(shard, cut_of)
            return
        from pagecli.loader.shards import take

        for name, weight in self.weights():
            yield name, take(shard, cut_of(name), name, weight)


def _kernels_reason() -> str | None:
    from pagecli_kernels import quant_cpu

    return quant_cpu.unavailable_reason()


def _mode(source: ModelSource, quantization: str, device: torch.device) -> str:
    """The mode `quantization` comes to: "gguf", "q8_0", "q4_k" or "none". Quiet: the
    refusals and the warning are plan_weights'."""
    if quantization == "none" or device.type != "cpu" or _kernels_reason() is not None:
        return "none"
    if quantization == "auto":
        return "gguf" if source.gguf_file is not None else "none"
    return quantization


def quantizes(
    source: ModelSource, quantization: str, device: torch.device, load_format: str = "auto"
) -> bool:
    """Whether `plan_weights` will keep or make block-format weights (and so float32
    activations for `--dtype auto`)."""
    if load_format == "dummy" or not source.has_weights:
        return False
    return _mode(source, quantization, device) != "none"


def plan_weights(
    source: ModelSource, quantization: str, device: torch.device, dtype: torch.dtype
) -> WeightPlan:
    """The plan for `source` under `--quantization`; ModelLoadError for a combination that
    cannot be honoured."""
    if quantization in ("q8_0", "q4_k"):
        if device.type != "cpu":
            raise ModelLoadError(f"--quantization {quantization} runs on the CPU only")
        if source.gguf_file is not None:
            raise ModelLoadError(
                f"{source.name}: a GGUF keeps its own formats; --quantization {quantization} "
                "quantizes safetensors checkpoints (use auto or none)"
            )
    if quantization != "none" and device.type == "cpu":
        reason = _kernels_reason()
        if reason is not None:
            if quantization != "auto":
                raise ModelLoadError(
                    f"--quantization {quantization}: quantized kernels unavailable ({reason})"
                )
            if source.gguf_file is not None:
                warnings.warn(
                    f"quantized CPU kernels unavailable ({reason}); GGUF weights are "
                    "dequantized to float32",
                    stacklevel=2,
                )
    mode = _mode(source, quantization, device)
    if source.gguf_file is not None:
        return _gguf_plan(source.gguf_file, keep=mode == "gguf", dtype=dtype)
    if not source.has_weights:
        return WeightPlan(mode="none")
    return _safetensors_plan(source, mode, dtype)


def _gguf_plan(path: Path, keep: bool, dtype: torch.dtype) -> WeightPlan:
    from pagecli.loader.gguf_weights import (
        GGUFError,
        check_expert_format,
        expert_count,
        file_arch,
        iter_gguf_weights,
        keeps_qk_pairs,
        kept_format,
        model_tensors,
        open_gguf,
    )

    try:
        reader = open_gguf(path)
        family = file_arch(reader, path)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None
    size = torch.tensor([], dtype=dtype).element_size()
    names: set[str] = set()
    blocks: dict[str, int] = {}
    resident = mapped = 0
    for t, name in model_tensors(reader, family):
        if keep and "{e}" in name and len(t.shape) == 3:
            try:  # at start, before the memory check counts the experts as float
                check_expert_format(t)
            except GGUFError as exc:
                raise ModelLoadError(f"{path}: {exc}") from None
        experts = [name.format(e=e) for e in range(expert_count(t))] if "{e}" in name else [name]
        dims = 3 if "{e}" in name else 2  # a 3-D expert stack: its experts' blocks
        fmt = kept_format(t)
        if keep and fmt is not None and len(t.shape) == dims:
            for expert in experts:
                names.add(expert)
                blocks[expert] = fmt.block_values
            mapped += int(t.n_bytes)
        else:
            resident += int(t.n_elements) * size

    def weights() -> Iterator[tuple[str, Weight]]:
        try:
            if keep:
                reader.advise_huge_pages()
            yield from iter_gguf_weights(reader, keep_quantized=keep)
        except GGUFError as exc:
            raise ModelLoadError(f"{path}: {exc}") from None
        finally:
            reader.close()  # loaded (or failed): the map goes with the last view of it

    qk_pairs = keeps_qk_pairs(reader, keep)
    mode = "gguf" if keep else "none"
    return WeightPlan(mode, names, resident + mapped, weights, mapped, qk_pairs, blocks)


def _safetensors_plan(source: ModelSource, mode: str, dtype: torch.dtype) -> WeightPlan:
    from pagecli.loader.weights import checkpoint_split, iter_safetensors, safetensors_shapes

    if mode == "none":
        kept: dict[str, int] = {}  # block-format tensors a family's cut makes (gpt-oss MXFP4)
        if checkpoint_split(source.path) is not None:
            for name, _, fmt in safetensors_shapes(source.path, source.name):
                if fmt is not None:
                    kept[name] = FORMATS[fmt].block_values
        return WeightPlan(
            "none",
            set(kept),
            weights=lambda: iter_safetensors(source.path, source.name),
            block_values=kept,
            read_shard=lambda shard, cut_of: iter_safetensors(
                source.path, source.name, shard, cut_of
            ),
        )
    from pagecli.loader.quant_cache import ensure_cache, iter_cached
    from pagecli.loader.quantize import wants_quantization, weight_format

    size = torch.tensor([], dtype=dtype).element_size()
    names: set[str] = set()
    blocks: dict[str, int] = {}
    resident = mapped = 0
    for name, shape, kept_fmt in safetensors_shapes(source.path, source.name):
        numel = 1
        for d in shape:
            numel *= d
        if kept_fmt is not None:  # blocks already (gpt-oss's MXFP4 experts): kept as they are
            fmt = FORMATS[kept_fmt]
            names.add(name)
            blocks[name] = fmt.block_values
            mapped += numel // fmt.block_values * fmt.block_bytes
        elif wants_quantization(name, len(shape)):
            fmt = FORMATS[weight_format(name, shape[1], mode)]
            names.add(name)
            blocks[name] = fmt.block_values
            mapped += numel // fmt.block_values * fmt.block_bytes
        else:
            resident += numel * size  # copied from the cache file into the parameters

    def weights() -> Iterator[tuple[str, Weight]]:
        # quantized once into the cache (loader/quant_cache.py), then read from its map
        yield from iter_cached(ensure_cache(source, mode))

    return WeightPlan(
        mode,
        names,
        resident + mapped,
        weights,
        mapped,
        block_values=blocks,
        prepare=lambda: ensure_cache(source, mode),
    )
