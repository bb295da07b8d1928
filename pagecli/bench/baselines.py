"""Hugging Face transformers baselines for `pagecli bench --compare hf`, on the same weights,
dtype and thread count as the engine: `hf-static` (model.generate in fixed, left-padded
batches) and `hf-cb` (transformers' own continuous batching, when installed).

Each request is `(prompt_token_ids, max_tokens)`; generation never stops early (no EOS), and
only each request's own `max_tokens` count as useful output.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

Request = tuple[list[int], int]
PAD_TOKEN_ID = 0


@dataclass
class BaselineRun:
    """The wall time of one baseline over a workload, and what it computed."""

    engine: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int  # useful tokens: each request's own max_tokens
    generated_tokens: int  # including the tokens of requests that had to wait for their batch


def hf_cb_available() -> str | None:
    """None when transformers has continuous batching (`generate_batch`), else why not."""
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa
    except ImportError:
        import transformers

        return f"transformers {transformers.__version__} has no continuous batching"
    return None


def load_hf_model(path: Path, dtype: torch.dtype, attn_implementation: str | None = None):
    """The transformers model of the engine's resolved HF folder, in eval mode."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    return model.eval()


def _greedy_config(max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=PAD_TOKEN_ID,
    )


@torch.inference_mode()
def _static_batch(model, batch: list[Request]) -> int:
    """Generate one left-padded batch to its longest request; returns tokens generated."""
    longest = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), longest), PAD_TOKEN_ID, dtype=torch.long)  # [B, S]
    attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)  # [B, S]
    for row, (ids, _) in enumerate(batch):
        input_ids[row, longest - len(ids) :] = torch.tensor(ids)
        attention_mask[row, longest - len(ids) :] = 1
    max_new = max(n for _, n in batch)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=_greedy_config(max_new),
    )  # [B, S + max_new]
    return (out.shape[1] - longest) * len(batch)


def run_hf_static(model, workload: list[Request], batch_size: int = 16) -> BaselineRun:
    """`model.generate` over the workload in its order, `batch_size` requests at a time."""
    _static_batch(model, [(workload[0][0][:8], 2)])  # warm-up
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(workload), batch_size):
        generated += _static_batch(model, workload[i : i + batch_size])
    wall = time.perf_counter() - start
    return BaselineRun(
        "hf-static",
        wall,
        sum(len(ids) for ids, _ in workload),
        sum(n for _, n in workload),
        generated,
    )


@torch.inference_mode()
def run_hf_cb(
    model, workload: list[Request], kv_tokens: int | None = None, quiet: bool = True
) -> BaselineRun:
    """transformers' continuous batching, each request with its own max_new_tokens, with a KV
    cache of `kv_tokens` (pagecli's capacity; None: transformers sizes it from memory, which
    on a CPU without psutil means most of the RAM)."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    if quiet:  # it logs set-up notes (e.g. about psutil) on its own logger
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)

    config = _greedy_config(max(n for _, n in workload))
    hints = WorkloadHints(
        max_prompt_length=max(len(ids) for ids, _ in workload),
        max_generated_length=max(n for _, n in workload),
        num_requests=len(workload),
    )
    cb_config = ContinuousBatchingConfig()
    if kv_tokens is not None:
        cb_config.num_blocks = max(1, -(-kv_tokens // cb_config.page_size))
    with model.continuous_batching_context_manager(
        generation_config=config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=5,
        workload_hints=hints,
    ) as manager:
        _cb_run(manager, [(workload[0][0][:8], 2)], prefix="warmup")
        start = time.perf_counter()
        generated = _cb_run(manager, workload, prefix="req")
        wall = time.perf_counter() - start
    return BaselineRun(
        "hf-cb",
        wall,
        sum(len(ids) for ids, _ in workload),
        sum(n for _, n in workload),
        generated,
    )


def _cb_run(manager, workload: list[Request], prefix: str) -> int:
    for i, (ids, max_tokens) in enumerate(workload):
        manager.add_request(
            list(ids), request_id=f"{prefix}-{i}", max_new_tokens=max_tokens, eos_token_id=-1
        )
    generated, pending = 0, len(workload)
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped unexpectedly")
            continue
        if result.is_finished():
            generated += len(result.generated_tokens)
            pending -= 1
    return generated
