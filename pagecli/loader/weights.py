"""Build a model from a resolved source: config, memory check, weights (safetensors or dummy)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagecli.errors import KVCacheMemoryError
from pagecli.loader.resolve import ModelLoadError
from pagecli.loader.shards import RankShard
from pagecli_kernels.quant_formats import QuantWeight

Weight = QuantWeight | torch.Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors' dtype names of the tensors pagecli reads: floats, and bytes (U8) that a
# family's cut repacks into blocks (gpt-oss's MXFP4 experts)
SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "U8": torch.uint8,
}


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters in their own dtypes (counted on the meta model: its
    own structure, whatever the family), and of any quantized layers' weights excluded:
    those come from the weight plan."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device`."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(
    needed: int, dtype: torch.dtype, device: torch.device, name: str, in_dtype: bool
) -> None:
    """Refuse, before loading, weights of `needed` bytes that cannot fit in the device's
    memory. `in_dtype`: they are every parameter in `dtype` (a smaller dtype would help);
    else what the weight plan keeps (quantized ones in their blocks)."""
    size = torch.tensor([], dtype=dtype).element_size()
    free = available_memory(device)
    if needed * 1.05 > free:
        smaller = [n for n, d in DTYPES.items() if torch.tensor([], dtype=d).element_size() < size]
        hint = f"; try --dtype {smaller[0]}" if smaller else ""
        what = f"in {str(dtype).removeprefix('torch.')}"
        if not in_dtype:
            what, hint = "as loaded", ""
        raise ModelLoadError(
            f"{name}: weights need {needed / 2**30:.1f} GiB {what}"
            f" but {device.type} has {free / 2**30:.1f} GiB available{hint}"
        )


GIB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine will hold resident, counted before anything is loaded: the weights
    read in place from a memory-mapped file (shared page cache, counted in RSS as file
    pages), the weights in the process's own memory, the KV cache, the swap space, and a
    step's work buffers at the batch limits (`workspace_bytes`). The interpreter and its
    libraries (about 0.2 GB for torch) come on top."""

    mapped: int
    anonymous: int
    kv: int
    swap: int
    workspace: int
    kv_layout: str = ""  # a hybrid model's KV groups (engine/kv_groups.py); "" otherwise
    states: int = 0  # recurrent layers' state slots (a slot per sequence) and snapshots
    states_layout: str = ""  # e.g. "128 slots + 16 snapshots"

    @property
    def total(self) -> int:
        return self.mapped + self.anonymous + self.kv + self.states + self.swap + self.workspace

    def line(self) -> str:
        """e.g. "3.89 GiB mapped weights + 0.02 GiB own + 2.00 GiB KV + 0.10 GiB workspace =
        6.01 GiB" (the swap space only when there is one)."""
        parts = [
            f"{self.mapped / GIB:.2f} GiB mapped weights",
            f"{self.anonymous / GIB:.2f} GiB own",
        ]
        kv = f"{self.kv / GIB:.2f} GiB KV"
        parts.append(f"{kv} ({self.kv_layout})" if self.kv_layout else kv)
        if self.states:
            parts.append(f"{self.states / GIB:.2f} GiB recurrent states ({self.states_layout})")
        if self.swap:
            parts.append(f"{self.swap / GIB:.2f} GiB swap")
        parts.append(f"{self.workspace / GIB:.2f} GiB workspace")
        return " + ".join(parts) + f" = {self.total / GIB:.2f} GiB"

    def as_dict(self) -> dict[str, int]:
        return {
            "mapped": self.mapped,
            "anonymous": self.anonymous,
            "kv": self.kv,
            "states": self.states,
            "swap": self.swap,
            "workspace": self.workspace,
            "total": self.total,
        }


def workspace_bytes(model, max_num_batched_tokens: int, max_num_seqs: int, dtype) -> int:
    """Bytes of a step's work buffers at the batch limits, the largest they get: the decoder
    layers' activations for `max_num_batched_tokens` tokens (the layer program's buffers,
    csrc/layer_program_cpu.c, with its float32 query and attention rows and the rotary rows)
    and the logits of `max_num_seqs` sequences in float32, three times over (logits,
    probabilities, the sampler's sort)."""
    widths = model.buffer_widths()
    size = torch.tensor([], dtype=dtype).element_size()
    rotary = sum(2 * r.rotary_dim for r in model.rotary.values())
    per_token = (sum(widths.values()) + rotary) * size + 2 * widths["attn"] * 4
    if size < 4:  # bfloat16: the projections' float32 input and output rows as well
        per_token += 2 * 4 * max(widths.values())
    logits = 3 * max_num_seqs * model.spec.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


def check_memory_fits(plan: MemoryPlan, device: torch.device, flag: str, value: str) -> None:
    """Refuse, before loading, a CPU engine whose weights, KV cache, swap space and work
    buffers together exceed the memory available (each alone was checked already): one line
    with the sum, naming the option that sized the KV cache."""
    if device.type != "cpu":
        return
    free = available_memory(device)
    if plan.total > free:
        raise KVCacheMemoryError(
            f"the engine needs {plan.line()}, more than the {free / GIB:.1f} GiB of memory "
            f"available; lower {flag}"
        )


def check_kv_fits(
    kv_bytes: int, swap_bytes: int, device: torch.device, flag: str, value: str
) -> None:
    """Refuse, before allocating, a KV cache of `kv_bytes` on `device` plus `swap_bytes` of
    host swap space that cannot fit in the memory available. `flag` and `value` name the
    option that set the size. The message is one line: requested and available GiB."""
    gib = 2**30
    host = torch.device("cpu")
    if device.type == "cpu":
        free = available_memory(host)
        if kv_bytes + swap_bytes > free:
            swap = f" plus {swap_bytes / gib:.1f} GiB of --swap-space" if swap_bytes else ""
            raise KVCacheMemoryError(
                f"a KV cache of {kv_bytes / gib:.1f} GiB ({flag} {value}){swap} does not fit "
                f"the {free / gib:.1f} GiB of memory available; lower {flag}"
                + (" or --swap-space" if swap_bytes else "")
            )
        return
    free = available_memory(device)
    if kv_bytes > free:
        raise KVCacheMemoryError(
            f"a KV cache of {kv_bytes / gib:.1f} GiB ({flag} {value}) does not fit the "
            f"{free / gib:.1f} GiB free on {device.type}; lower {flag}"
        )
    if swap_bytes:
        free = available_memory(host)
        if swap_bytes > free:
            raise KVCacheMemoryError(
                f"a swap space of {swap_bytes / gib:.1f} GiB (--swap-space) does not fit the "
                f"{free / gib:.1f} GiB of host memory available; lower --swap-space"
            )


def checkpoint_names(folder: Path) -> Callable[[str], str | None] | None:
    """The map from a checkpoint's tensor names to the names its family's modules take, or
    None where they are the same: a multimodal checkpoint's language model
    ("model.language_model.x" -> "model.x", lm_head as it is; None for the rest: vision
    tower, MTP head), and a family's own renames (CausalLM.rename_tensor: Mixtral's)."""
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    if not architectures:
        return None
    from pagecli.models.base import CausalLM
    from pagecli.models.registry import checkpoint_class, multimodal_text_model

    cls = checkpoint_class(architectures)
    found = multimodal_text_model(architectures)
    renames = cls is not None and cls.rename_tensor.__func__ is not CausalLM.rename_tensor.__func__
    if found is None and not renames:
        return None
    prefix = found[1] if found is not None else None

    def rename(name: str) -> str | None:
        if prefix is not None:
            if name.startswith(prefix):
                name = "model." + name[len(prefix) :]
            elif not name.startswith("lm_head."):
                return None
        return cls.rename_tensor(name)

    return rename


def checkpoint_split(folder: Path) -> Unstack | None:
    """The family's cut of checkpoint tensors that hold several of its tensors
    (CausalLM.split_tensor, for the names ending in its split_names), or None where it has
    none. One pass over a checkpoint's tensors takes a fresh one (it holds what a cut keeps
    until a later tensor completes it)."""
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    from pagecli.models.registry import checkpoint_class

    cls = checkpoint_class(architectures or ())
    if cls is None or not cls.split_names:
        return None
    return Unstack(tuple(cls.split_names), cls.split_tensor)


@dataclass
class Unstack:
    """Which checkpoint tensors a family cuts (names ending in `ends`) and how (`split`:
    CausalLM.split_tensor); `held`: what a cut keeps until a later tensor of the same pass
    completes it (gpt-oss's MXFP4 blocks wait for their scales)."""

    ends: tuple[str, ...]
    split: Callable[[str, torch.Tensor, dict], list[tuple[str, Weight]]]
    held: dict = field(default_factory=dict)

    def takes(self, name: str) -> bool:
        return name.endswith(self.ends)

    def cut(self, name: str, tensor: torch.Tensor) -> list[tuple[str, Weight]]:
        return self.split(name, tensor, self.held)


def split_shape(
    split: Unstack | None, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> list[tuple[str, tuple[int, ...], str | None]]:
    """The names, shapes and block formats (None: a float tensor) of what `split` cuts a
    tensor of `shape` into (itself when none); a cut that waits for a later tensor gives
    none here, and that tensor's cut gives them."""
    if split is None or not split.takes(name):
        return [(name, shape, None)]
    pieces = split.cut(name, torch.empty(shape, dtype=dtype, device="meta"))
    return [
        (n, tuple(t.shape), t.format.name if isinstance(t, QuantWeight) else None)
        for n, t in pieces
    ]


def iter_safetensors(
    folder: Path, name: str, shard: RankShard | None = None, cut_of=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every *.safetensors file in the folder; with a
    tensor-parallel `shard`, only that rank's slice of each is read (`cut_of(name)`: the
    model's cut of it, RankShard.cut)."""
    from safetensors import safe_open

    from pagecli.loader.shards import read_slice, take

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{name}: no *.safetensors weights in {folder}")
    rename = checkpoint_names(folder)
    split = checkpoint_split(folder)
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for stored in f.keys():
                    key = stored if rename is None else rename(stored)
                    if key is None:
                        continue
                    if split is not None and split.takes(key):  # read whole, then cut
                        for piece, tensor in split.cut(key, f.get_tensor(stored)):
                            if isinstance(tensor, QuantWeight) and shard is not None:
                                tensor = take(shard, cut_of(piece), piece, tensor)
                            elif shard is not None:
                                tensor = read_slice(shard, cut_of(piece), tensor)
                            yield piece, tensor
                    elif shard is None:
                        yield key, f.get_tensor(stored)
                    else:
                        yield key, read_slice(shard, cut_of(key), f.get_slice(stored))
        except ModelLoadError:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModelLoadError(
                f"{file}: corrupt safetensors file ({type(exc).__name__}: {first})"
            ) from None


def safetensors_shapes(
    folder: Path, name: str
) -> Iterator[tuple[str, tuple[int, ...], str | None]]:
    """(name, shape, block format or None) of every tensor in the folder's *.safetensors files
    as the model takes them (split_shape), without reading them."""
    from safetensors import safe_open

    rename = checkpoint_names(folder)
    split = checkpoint_split(folder)
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for stored in f.keys():
                    key = stored if rename is None else rename(stored)
                    if key is not None:
                        piece = f.get_slice(stored)
                        dtype = SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.float32)
                        yield from split_shape(split, key, tuple(piece.get_shape()), dtype)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModelLoadError(
                f"{file}: corrupt safetensors file ({type(exc).__name__}: {first})"
            ) from None


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights of the right scale, for benchmarks of models that are not downloaded."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                # Drawn where the parameter lives: an 8B model on a GPU fills in seconds.
                gen = generators.get(param.device)
                if gen is None:
                    gen = torch.Generator(device=param.device).manual_seed(seed)
                    generators[param.device] = gen
                param.normal_(0.0, 0.02, generator=gen)
