"""The GGUF reader (loader/gguf_file.py) and the conversion and tokenizer built on it: the
same metadata and tensors as gguf.GGUFReader, the same config and tokenizer files as
transformers' `gguf_file=` loaders, and the same token ids as transformers' tokenizer."""

from __future__ import annotations

import json
import mmap
import struct

import gguf
import numpy as np
import pytest

from pagecli.loader.gguf_convert import convert_gguf
from pagecli.loader.gguf_file import GGUFFile, GGUFFormatError, open_gguf_file
from pagecli.loader.gguf_weights import gguf_tensor_bytes
from pagecli.loader.light_tokenizer import LightTokenizer
from pagecli.loader.model_config import ModelConfig, load_full_config
from pagecli.loader.resolve import (
    ModelLoadError,
    converted_tokenizer_backend,
    default_gguf_path,
    resolve_model,
)
from pagecli.tokenizer import Tokenizer
from tests.gguf_models import write_tiny_gguf

TEXTS = [
    "",
    "hi",
    "The capital of France is",
    " leading space and trailing ",
    "code:\n\tdef f(x):\n\t\treturn x  # tabs\r\n",
    "naïve café, 東京, 🙂 and ZWJ 👩‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "<|im_start|",  # a special token cut short is plain text
    "x" * 500,
]
CONVERSATIONS = [
    [{"role": "user", "content": "Say hi"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "<|im_end|> and 日本"},
    ],
]


def _same_as_gguf_reader(path) -> None:
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(str(path), "c")
    assert ours.keys() == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key in ours.keys():
        value = ours.get(key)
        value = value.tolist() if isinstance(value, np.ndarray) else value
        assert value == theirs.fields[key].contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
        )
        assert a.shape.tolist() == b.shape.tolist() and a.data_offset == b.data_offset
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_reader_matches_gguf_reader_on_the_default_model():
    _same_as_gguf_reader(default_gguf_path())


@pytest.mark.parametrize("kind", ["q8_0", "q4_k", "mixed"])
def test_reader_matches_gguf_reader_on_tiny_files(tmp_path, kind):
    _same_as_gguf_reader(write_tiny_gguf(tmp_path / f"{kind}.gguf", kind, seed=7))


def test_one_parse_per_process_and_release(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "q8_0", seed=1)
    reader = open_gguf_file(path)
    assert open_gguf_file(path) is reader
    first = max(reader.tensors, key=lambda t: t.n_bytes)  # many pages
    before = first.data.copy()
    calls = []

    class Recording:  # the map's madvise, watched (the mmap type's methods are read-only)
        def __init__(self, real):
            self.real = real

        def madvise(self, *args):
            calls.append(args)
            return self.real.madvise(*args)

    reader._mmap = Recording(reader._mmap)
    reader.release(first)  # pages dropped: read again from the file, unchanged
    page = mmap.PAGESIZE
    start = -(-first.data_offset // page) * page  # the whole pages inside the tensor
    end = (first.data_offset + first.n_bytes) // page * page
    assert calls == [(mmap.MADV_DONTNEED, start, end - start)] and end > start
    assert np.array_equal(first.data, before)
    reader.close()
    assert open_gguf_file(path) is not reader
    assert np.array_equal(first.data, before)  # a closed reader maps the file again
    assert gguf_tensor_bytes(path) > 0


def _header(version: int = 3, num_tensors: int = 0, num_kv: int = 0) -> bytes:
    return struct.pack("<IIQQ", gguf.GGUF_MAGIC, version, num_tensors, num_kv)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "empty"),
        (b"GGUF", "too short"),
        (b"NOPE" + b"\0" * 40, "magic"),
        (struct.pack("<I", gguf.GGUF_MAGIC) + struct.pack(">I", 3) + b"\0" * 16, "big-endian"),
        (_header(version=9), "version 9"),
        (_header(num_kv=1) + struct.pack("<Q", 1000) + b"key", "runs past"),
        (_header(num_kv=5), "truncated"),
        # an array whose count is past any offset, or past the file
        (_header(num_kv=1) + _key("a") + struct.pack("<IIQ", 9, 4, 2**63), "runs past"),
        (_header(num_kv=1) + _key("a") + struct.pack("<IIQ", 9, 8, 2**62), "truncated"),
        (_header(num_kv=1) + _key("a") + struct.pack("<IIQ", 9, 9, 2**62), "truncated"),
        # arrays of arrays of ... nested deeper than any file needs
        (
            _header(num_kv=1) + _key("a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 20,
            "nested",
        ),  # fmt: skip
        # a tensor whose dimensions multiply past 2^64, or has too many of them
        (
            _header(num_tensors=1)
            + _key("t")
            + struct.pack("<I4Q", 4, *[2**32] * 4)
            + struct.pack("<IQ", 0, 0),
            "runs past",
        ),  # fmt: skip
        (_header(num_tensors=1) + _key("t") + struct.pack("<I", 9) + b"\0" * 80, "dimensions"),
        (_header(num_tensors=1) + _key("t") + struct.pack("<IQIQ", 1, 32, 99, 0), "ggml type"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, data, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(GGUFFormatError, match=message):
        GGUFFile(bad)


def test_bad_file_through_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGECLI_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "short.gguf"
    bad.write_bytes(_header(num_kv=3))
    with pytest.raises(ModelLoadError, match=r"short\.gguf: not a readable GGUF file"):
        resolve_model(str(bad))


# ---- the conversion: transformers' own results, without gguf.GGUFReader -------------------


@pytest.fixture(scope="module")
def transformers_gguf():
    """The default model's config and tokenizer as transformers' `gguf_file=` loaders make
    them (the old conversion: gguf.GGUFReader under transformers, seconds)."""
    from transformers import AutoConfig, AutoTokenizer

    path = default_gguf_path()
    folder, name = str(path.parent), path.name
    return AutoConfig.from_pretrained(folder, gguf_file=name), AutoTokenizer.from_pretrained(
        folder, gguf_file=name
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("converted")
    info = convert_gguf(default_gguf_path(), out)
    return out, info


def test_conversion_writes_what_transformers_writes(converted, transformers_gguf, tmp_path):
    out, info = converted
    config, tokenizer = transformers_gguf
    assert info == {"tokenizer": "tokenizers"}
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_tiny_file_config_is_transformers_config(tmp_path):
    from transformers import AutoConfig

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "mixed", seed=3)
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    info = convert_gguf(path, tmp_path / "out")
    assert info == {"tokenizer": None}
    ours = json.loads((tmp_path / "out" / "pagecli-config.json").read_text())
    theirs["architectures"] = ["LlamaForCausalLM"]
    theirs["tie_word_embeddings"] = ours["tie_word_embeddings"]
    skip = ("transformers_version", "_name_or_path")  # the library's version, the folder
    assert {k: v for k, v in ours.items() if k not in skip} == {
        k: v for k, v in json.loads(json.dumps(theirs)).items() if k not in skip
    }


def test_full_config_holds_every_transformers_attribute(converted):
    from transformers import AutoConfig

    out, _ = converted
    light = load_full_config(out)
    assert isinstance(light, ModelConfig)
    theirs = AutoConfig.from_pretrained(str(out))
    for key, value in json.loads(theirs.to_json_string(use_diff=False)).items():
        if key != "_name_or_path":
            assert getattr(light, key) == value, key
    for key in ("sliding_window", "use_sliding_window", "rope_theta"):
        assert getattr(light, key, None) == getattr(theirs, key, None), key


def test_other_rope_types_keep_transformers_config(converted, tmp_path):
    out, _ = converted
    values = json.loads((out / "pagecli-config.json").read_text())
    values["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    (tmp_path / "pagecli-config.json").write_text(json.dumps(values))
    assert load_full_config(tmp_path) is None


# ---- token ids: the engine's tokenizer against transformers' -------------------------------


@pytest.fixture(scope="module")
def engine_tokenizer():
    source = resolve_model(None)
    assert converted_tokenizer_backend(source.path) == "tokenizers"
    tokenizer = Tokenizer(source.path, source.name)
    assert isinstance(tokenizer.hf, LightTokenizer)
    return tokenizer


def test_ids_match_transformers(engine_tokenizer, transformers_gguf):
    """Text, special tokens inside text, decoding with and without them, the vocabulary size
    and EOS: the same as transformers' tokenizer made from the GGUF file."""
    _, hf = transformers_gguf
    tok = engine_tokenizer
    assert tok.vocab_size == len(hf) and tok.eos_token_id == hf.eos_token_id
    for text in TEXTS:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add)
            assert tok.encode(text, add_special_tokens=add) == ids, text
            for skip in (True, False):
                assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    every = list(range(0, len(hf), 97)) + list(range(20))
    for skip in (True, False):
        assert tok.decode(every, skip) == hf.decode(every, skip_special_tokens=skip)


def test_chat_template_matches_transformers(engine_tokenizer, transformers_gguf):
    _, hf = transformers_gguf
    for messages in CONVERSATIONS:
        for add in (True, False):
            text = hf.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
            assert engine_tokenizer.apply_chat_template(messages, add) == text
            ids = hf.encode(text, add_special_tokens=False)
            assert engine_tokenizer.encode_chat(messages, add) == ids


def test_template_override_and_sandbox(engine_tokenizer, tmp_path):
    import jinja2

    source = resolve_model(None)
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] | upper }}={{ m['content'] | tojson }};"
        "{% endfor %}{{ bos_token }}{% if add_generation_prompt %}>{% endif %}"
    )
    tok = Tokenizer(source.path, source.name, chat_template=str(template))
    assert tok.template_source == "file"
    text = tok.apply_chat_template([{"role": "user", "content": "é<"}], True)
    assert text == 'USER="é<";<|im_start|>>'
    escape = "{{ messages.__class__.__mro__ }}"
    template.write_text(escape)
    tok = Tokenizer(source.path, source.name, chat_template=str(template))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}], True)
