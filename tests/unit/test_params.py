"""EngineConfig and SamplingParams validate once and name the bad field."""

from __future__ import annotations

import pytest

from pagecli import EngineConfig, SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("seed", -1),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("ignore_eos", "yes"),
        ("temperature", float("nan")),
        ("max_tokens", True),
        # Hostile values that used to break a whole batch (NaN probabilities, a generator
        # that cannot take the seed, n samples allocated at once).
        ("temperature", 1e-300),
        ("repetition_penalty", 1e-300),
        ("seed", 2**64 + 5),
        ("n", 10**9),
    ],
)
def test_sampling_params_reject(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_accept():
    p = SamplingParams(stop="###", temperature=0)
    assert p.stop == ["###"] and p.greedy and not p.has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties


@pytest.mark.parametrize(
    "field,value",
    [
        ("dtype", "float8"),
        ("device", "tpu"),
        ("block_size", 3),
        ("block_size", 256),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 0),
        ("kv_cache_memory", 0),
        ("gpu_memory_utilization", 1.5),
        ("preemption_mode", "drop"),
        ("swap_space", -1),
        ("num_threads", 0),
        ("load_format", "pickle"),
    ],
)
def test_engine_config_reject(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
