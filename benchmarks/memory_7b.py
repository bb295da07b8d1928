"""Load time and memory of a 7B model on the CPU: a Q4_K_M GGUF, and float16 safetensors
quantized at load (`--quantization q4_k`), the first start (quantizing into the cache) and
the second (mapping the cache).

Writes, once, under --dir:
- `7b-q4_k_m.gguf`: Llama-2-7B's shapes (hidden 4096, 32 layers, 32 heads, ffn 11008) in
  llama.cpp's Q4_K_M mix, random valid blocks (benchmarks/shaped_gguf.py), with the default
  model's tokenizer and its 49,152-token vocabulary;
- `7b-f16/`: the same shapes as a float16 safetensors checkpoint in two shards as the hub
  has it (model-0000N-of-00002.safetensors, written tensor by tensor: this script never
  holds a shard), random normal weights of std 0.02, config.json and the tokenizer.

Each measurement runs in a fresh process (`LLM(...)`, then one greedy request of 16 prompt
and 8 output tokens) and reports the load time, the peak RSS (VmHWM: anonymous plus mapped
file pages, what /usr/bin/time calls maximum resident set size), and the steady RSS after the
request split into anonymous and file pages. The GGUF start is a warm one (its tokenizer
converted beforehand, as after any first start). The quantized cache goes to a fresh
PAGECLI_CACHE_DIR under --dir, so the first safetensors start always quantizes.

    .venv/bin/python benchmarks/memory_7b.py [--dir /tmp/pagecli-7b] [--kv-gib 2]
        [--json OUT.json]
    .venv/bin/python benchmarks/memory_7b.py --shape smoke   # a tiny run of this script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHAPES = {  # hidden, layers, heads, kv heads, ffn
    "7b": (4096, 32, 32, 32, 11008),
    "smoke": (256, 2, 4, 4, 512),
}
VOCAB = 49152

CHILD = """
import json, sys, time
start = time.perf_counter()
from pagecli import LLM, SamplingParams
model, quantization, kv = sys.argv[1], sys.argv[2], float(sys.argv[3])
llm = LLM(model, quantization=quantization, kv_cache_memory=kv)
loaded = time.perf_counter() - start
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
out = llm.generate([{"prompt_token_ids": list(range(1000, 1016))}], params)[0]
status = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("VmHWM", "RssAnon", "RssFile"):
        status[key] = int(value.split()[0]) * 1024
memory = llm.engine.runner.memory.as_dict()
print(json.dumps({"load_s": loaded, "tokens": out.token_ids, "memory": memory, **status}))
"""


def tensor_shapes(shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    hidden, layers, heads, kv_heads, ffn = shape
    kv = hidden // heads * kv_heads
    out = [("model.embed_tokens.weight", (VOCAB, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (ffn, hidden)),
            (p + "mlp.up_proj.weight", (ffn, hidden)),
            (p + "mlp.down_proj.weight", (hidden, ffn)),
        ]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (VOCAB, hidden))]


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng) -> None:
    """A float16 safetensors file, streamed: the header, then each tensor's bytes."""
    header, offset = {}, 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * 2
        header[name] = {
            "dtype": "F16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    pool = (rng.standard_normal(1 << 22) * 0.02).astype(np.float16)  # reused, shifted
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in tensors:
            numel = int(np.prod(shape))
            if name.endswith("norm.weight"):
                f.write(np.ones(numel, dtype=np.float16).tobytes())
                continue
            done = 0
            while done < numel:
                n = min(numel - done, pool.size)
                f.write(np.roll(pool, int(rng.integers(pool.size)))[:n].tobytes())
                done += n
    os.replace(partial, path)


def ensure_checkpoint(folder: Path, shape_name: str) -> Path:
    """The float16 checkpoint folder: two shards, config.json and the tokenizer."""
    hidden, layers, heads, kv_heads, ffn = SHAPES[shape_name]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    tensors = tensor_shapes(SHAPES[shape_name])
    half = len(tensors) * 3 // 4  # the hub's split: a large first shard
    shards = [tensors[:half], tensors[half:]]
    names = [f"model-{i + 1:05d}-of-00002.safetensors" for i in range(2)]
    if all((folder / n).exists() for n in names) and (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    from pagecli.loader.resolve import resolve_model

    default = resolve_model(None).path
    for f in default.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for name, part in zip(names, shards, strict=True):
        write_safetensors(folder / name, part, rng)
    print(f"memory_7b: wrote {folder} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return folder


def ensure_gguf(folder: Path, shape_name: str) -> Path:
    sys.path.insert(0, str(HERE))
    import shaped_gguf

    if shape_name == "smoke":
        return shaped_gguf.ensure_file(folder, "smoke", "q4_k_m", None)
    return shaped_gguf.ensure_file(folder, "7b", "q4_k_m", None)


def measure(model: Path, quantization: str, kv_gib: float, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), quantization, str(kv_gib)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"memory_7b: {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pagecli-7b"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--kv-gib", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    folder = args.dir / args.shape
    gguf_path = ensure_gguf(folder, args.shape)
    checkpoint = ensure_checkpoint(folder / f"{args.shape}-f16", args.shape)
    cache = folder / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, PAGECLI_CACHE_DIR=str(cache))
    sys.path.insert(0, str(HERE))
    from quant_vs_llamacpp import cpu_name

    from pagecli.loader.resolve import resolve_model

    resolve_model(str(gguf_path))  # its tokenizer and config converted once, as any start
    runs = {
        "gguf q4_k_m": measure(gguf_path, "auto", args.kv_gib, dict(os.environ)),
        "f16 -> q4_k, first start": measure(checkpoint, "q4_k", args.kv_gib, env),
        "f16 -> q4_k, second start": measure(checkpoint, "q4_k", args.kv_gib, env),
    }
    file_gb = gguf_path.stat().st_size / 1e9
    cached = sorted((cache / "quantized").glob("*.gguf"))
    print(f"CPU: {cpu_name()}; KV cache {args.kv_gib:g} GiB; GGUF {file_gb:.2f} GB; "
          f"q4_k cache {cached[0].stat().st_size / 1e9:.2f} GB" if cached else "")  # fmt: skip
    print("| load | time s | peak RSS GB | steady anon GB | steady file GB | planned GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        planned = r["memory"]["total"] / 2**30
        print(f"| {name} | {r['load_s']:.1f} | {r['VmHWM'] / 1e9:.2f} | {r['RssAnon'] / 1e9:.2f} "
              f"| {r['RssFile'] / 1e9:.2f} | {planned:.2f} |")  # fmt: skip
    same = runs["f16 -> q4_k, first start"]["tokens"] == runs["f16 -> q4_k, second start"]["tokens"]
    print(f"greedy tokens of the first and second start identical: {same}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
