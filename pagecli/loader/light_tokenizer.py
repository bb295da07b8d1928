"""A converted GGUF's tokenizer without transformers: tokenizer.json through `tokenizers`, the
chat template through jinja2 in the environment transformers renders templates in.

transformers' TokenizersBackend is a thin layer over the same `tokenizers` object (encode,
decode, vocabulary size); importing transformers costs about a second and 100 MB at every
start. gguf_convert.py writes the folder with transformers once and only marks it for this
class after `agrees_with` found the two give the same ids, text and rendered templates; any
other folder loads transformers' tokenizer as before.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): the template sees them.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# tokenizer_config.json keys under which transformers' tokenizer behaves differently from the
# bare `tokenizers` object: such a folder keeps the transformers tokenizer.
_TRANSFORMERS_ONLY_KEYS = (
    "add_bos_token",
    "add_eos_token",
    "clean_up_tokenization_spaces",
    "split_special_tokens",
    "auto_map",
)


class LightTokenizer:
    """The part of a transformers tokenizer that pagecli uses (encode, decode, len,
    eos_token_id, chat_template, apply_chat_template), over a folder's tokenizer.json."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        folder = Path(folder)
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # transformers switches both off for every plain encode
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        config = _tokenizer_config(folder)
        self.special_tokens_map = {
            name: _content(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name)
        }
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            self.chat_template: str | None = template_file.read_text()
        else:
            self.chat_template = config.get("chat_template")
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = self._tokenizer.token_to_id(eos) if eos is not None else None

    @staticmethod
    def suits(folder: Path) -> bool:
        """Whether the folder's tokenizer is one this class reproduces (tokenizer.json, no
        options that transformers applies on top of it)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            return False
        config = _tokenizer_config(folder)
        return not any(config.get(key) for key in _TRANSFORMERS_ONLY_KEYS)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def backend_tokenizer(self):
        """The `tokenizers` object (as transformers' fast tokenizers name it)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation rendered as transformers' apply_chat_template(tokenize=False)
        renders plain role/content messages."""
        if tokenize:
            raise ValueError("LightTokenizer renders text only (tokenize=False)")
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        # as transformers: message keys whose value is None are dropped
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        return _compiled(self.chat_template).render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )


def _tokenizer_config(folder: Path) -> dict:
    """The folder's tokenizer_config.json ({} when it has none)."""
    config_file = folder / "tokenizer_config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}


def _content(token: Any) -> str:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    return token["content"] if isinstance(token, dict) else str(token)


_TEMPLATES: dict[str, Any] = {}


def _compiled(template: str):
    """The template compiled in transformers' environment (chat_template_utils.py): a
    sandbox that cannot change its inputs, trim_blocks and lstrip_blocks, loop controls, the
    `generation` tag, `tojson` without HTML escaping, `raise_exception`, `strftime_now`, and
    `dict`/`namespace` that refuse underscore names."""
    if template in _TEMPLATES:
        return _TEMPLATES[template]
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks
        the assistant's spans there; plain rendering does not need them)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes ({name!r})"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    compiled = env.from_string(template)
    _TEMPLATES[template] = compiled
    return compiled


# Inputs on which a converted folder's LightTokenizer must match transformers' tokenizer.
_PROBE_TEXTS = (
    "",
    "hi",
    "Hello, world! How are you?",
    "  two leading spaces, trailing space ",
    "lines\nand\n\nblank lines\r\n\ttabs",
    "numbers 1234567 3.14159 and symbols @#$%^&*()_+{}|",
    "unicode: héllo wörld, 日本語, emoji 🙂👍🏽, Ελληνικά",
)


def agrees_with(light: LightTokenizer, hf) -> bool:
    """Whether `light` gives the same ids, text, size and rendered templates as the
    transformers tokenizer `hf` on probe inputs (special tokens inside text included)."""
    specials = [t for t in hf.special_tokens_map.values() if isinstance(t, str)]
    texts = list(_PROBE_TEXTS) + [f"a{t}b {t} c" for t in specials] + ["".join(specials)]
    if len(light) != len(hf) or light.eos_token_id != hf.eos_token_id:
        return False
    if light.special_tokens_map != hf.special_tokens_map:
        return False
    for text in texts:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add)
            if light.encode(text, add_special_tokens=add) != ids:
                return False
            for skip in (True, False):
                if light.decode(ids, skip) != hf.decode(ids, skip_special_tokens=skip):
                    return False
    if (light.chat_template or None) != (getattr(hf, "chat_template", None) or None):
        return False
    if light.chat_template:
        conversations = [
            [{"role": "user", "content": "hi"}],
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": _PROBE_TEXTS[4]},
                {"role": "assistant", "content": _PROBE_TEXTS[6]},
                {"role": "user", "content": "and?"},
            ],
        ]
        for messages in conversations:
            for add in (True, False):
                if _rendered(light, messages, add) != _rendered(hf, messages, add):
                    return False
    return True


def _rendered(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str | None:
    """The rendered conversation, or None where the template refuses it."""
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception:  # a template's raise_exception, or any error inside it
        return None
