"""Quality of quantize-at-load (`--quantization q8_0 | q4_k`) against float32, measured.

On the default model's weights (its GGUF dequantized to a float32 safetensors checkpoint):
- top-1 agreement: float32 greedily continues 20 English prompts by 64 tokens; each
  quantized model then predicts every one of those 20 x 64 tokens from the same prefix
  (teacher-forced), and the share of its argmaxes equal to float32's token is reported;
- perplexity of each model on a short English text (one teacher-forced pass).
The file's own formats (`auto`, Q4_1 with a Q8_0 embedding, computed from the blocks) are a
control row: their float32 reference is exact, so they should agree all but ties.

    .venv/bin/python benchmarks/quant_quality.py [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from pagecli import LLM, SamplingParams
from pagecli.layers.attention import AttentionMetadata
from pagecli.loader.resolve import float_checkpoint, resolve_model

PROMPTS = [
    "The history of the printing press begins",
    "To bake a loaf of sourdough bread, you first",
    "The main causes of the French Revolution were",
    "In the deep ocean, far below the reach of sunlight,",
    "A good night's sleep matters because",
    "The first thing to know about learning a new language is",
    "When the train finally pulled into the station,",
    "Photosynthesis is the process by which plants",
    "The old lighthouse keeper climbed the stairs and",
    "Here are three tips for writing clear emails:",
    "The city council met on Tuesday to discuss",
    "Volcanoes form when magma from deep inside the Earth",
    "She opened the letter slowly, afraid of what",
    "The best way to explain gravity to a child is",
    "Early computers filled entire rooms and used",
    "A healthy breakfast usually includes",
    "The museum's new exhibition shows paintings that",
    "Mountains affect the weather around them because",
    "After the storm passed, the villagers",
    "Bees are important to farmers because they",
]
TEXT = (
    "The river runs through the middle of the town, and for as long as anyone can remember "
    "it has shaped the lives of the people who live there. In spring the water rises with the "
    "melting snow from the hills, and the fields along its banks turn green almost overnight. "
    "Farmers plant wheat and barley, and children walk along the paths on their way to school, "
    "stopping to watch the ducks and the small boats that carry goods to the market. In the "
    "summer the river is slow and warm, and families come down in the evenings to swim and to "
    "eat together under the trees. Autumn brings rain and fog, and the mills that once ground "
    "the grain stand quiet now, turned into a library and a small museum about the town's "
    "past. In winter the edges of the water freeze, and the old bridge, built of grey stone "
    "more than two hundred years ago, is lit by lamps that make the snow shine gold. People "
    "say that the river is the reason the town exists at all, and that as long as it keeps "
    "flowing, the town will go on."
)
NEW_TOKENS = 64


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The model's logits at every position of `ids` in one prefill: [T, V] float32. Writes
    the idle engine's first KV blocks (prefix caching is off, so nothing else reads them)."""
    runner = llm.engine.runner
    num_tokens = len(ids)
    num_blocks = -(-num_tokens // runner.block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_seq_lens=None,
        prefill_block_tables=torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0),
        prefill_seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        prefill_query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
    )
    model = runner.model
    hidden = model(torch.tensor(ids), torch.arange(num_tokens), meta)  # [T, H]
    return model.compute_logits(hidden)  # [T, V]


def perplexity(llm: LLM, ids: list[int]) -> float:
    logits = teacher_forced_logits(llm, ids)[:-1]  # predicting ids[1:]
    nll = torch.nn.functional.cross_entropy(logits.double(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def agreement(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    hits = total = 0
    for prompt, cont in zip(prompts, continuations):
        logits = teacher_forced_logits(llm, prompt + cont)  # [P + N, V]
        predicted = logits[len(prompt) - 1 : len(prompt) - 1 + len(cont)].argmax(-1)
        hits += int((predicted == torch.tensor(cont)).sum())
        total += len(cont)
    return hits / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    source = resolve_model(None)
    folder = str(float_checkpoint(source))
    # float32 pinned: `auto` is bfloat16 for float checkpoints on CPUs with fast bfloat16
    # (AMX), which made the "float32" reference a bfloat16 one there
    common = dict(
        num_threads=args.threads, enable_prefix_caching=False, num_kv_blocks=64, dtype="float32"
    )
    reference = LLM(folder, quantization="none", **common)
    tok = reference.engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    text_ids = tok.encode(TEXT)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = reference.generate([{"prompt_token_ids": p} for p in prompts], params)
    continuations = [list(o.outputs[0].token_ids) for o in outputs]
    rows = [
        {
            "weights": "float32 (reference)",
            "top1_agreement": agreement(reference, prompts, continuations),
            "perplexity": perplexity(reference, text_ids),
        }
    ]
    del reference
    for label, model, mode in (
        ("q8_0 (quantized at load)", folder, "q8_0"),
        ("q4_k (quantized at load)", folder, "q4_k"),
        ("GGUF as stored (Q4_1, Q8_0 embedding)", None, "auto"),
    ):
        start = time.perf_counter()
        llm = LLM(model, quantization=mode, **common)
        load_s = time.perf_counter() - start
        rows.append(
            {
                "weights": label,
                "formats": llm.engine.runner.model.weight_formats,
                "load_s": load_s,
                "top1_agreement": agreement(llm, prompts, continuations),
                "perplexity": perplexity(llm, text_ids),
            }
        )
        del llm
    result = {
        "prompts": len(prompts),
        "tokens_per_prompt": NEW_TOKENS,
        "text_tokens": len(text_ids),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{len(prompts)} prompts x {NEW_TOKENS} tokens; perplexity over {len(text_ids)} tokens")
    print("| weights | top-1 agreement with float32 | perplexity |")
    print("| --- | --- | --- |")
    for row in rows:
        agree = f"{100 * row['top1_agreement']:.1f}%"
        print(f"| {row['weights']} | {agree} | {row['perplexity']:.3f} |")


if __name__ == "__main__":
    main()
