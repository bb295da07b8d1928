"""Mixture-of-experts models pagecli cannot run, from the command line: an expert count the
tensors contradict, a router scoring it does not know, and a GGUF whose expert stacks are in
a block format it does not keep (Q2_K: expanded to float32 they would not fit where the
blocks do) each end in one stderr line naming what is wrong, exit 2, nothing on stdout."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cli.helpers import TIMEOUT_S, jsonl, start


def _edited(source, folder, **changes):
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("case", ["expert count", "router", "expert format"])
def test_bad_moe_models_are_one_line_exit_2(moe_models, tmp_path, case):
    from tests.gguf_families import write_family_gguf

    if case == "expert count":
        model = _edited(moe_models["olmoe"], tmp_path / "fewer", num_experts=6)
        args, words = ["--quantization", "none"], ["expert 6", "6 experts"]
    elif case == "router":
        model = _edited(moe_models["qwen3_moe"], tmp_path / "sigmoid", scoring_func="sigmoid")
        args, words = [], ["router scoring 'sigmoid'"]
    else:  # Q2_K's super-blocks of 256: experts that wide
        from tests.tiny_models import wide_moe_model

        wide = wide_moe_model(tmp_path / "wide", "olmoe")
        model, _ = write_family_gguf(wide, tmp_path, "olmoe", "q8_0", "q2_k")
        args, words = [], ["_exps.weight", "experts in Q2_K are not supported", "MXFP4"]
    proc = start(["generate", "--model", str(model), *args])
    out, err = proc.communicate(jsonl({"prompt_token_ids": [5, 6, 7]}), timeout=TIMEOUT_S)
    lines = err.decode().splitlines()
    assert proc.returncode == 2, lines
    assert out == b""
    assert len(lines) == 1 and lines[0].startswith("pagecli: "), lines
    assert all(word in lines[0] for word in words), lines
