"""The tables of docs/ that code knows: the model families (from models/registry.py), the
GGUF block formats kept in memory (pagecli_kernels/quant_formats.py), the tool-call formats
(server/tool_calls), each command's flags (the Typer app in cli/app.py, as `--help` shows
them) and the Prometheus metrics of `pagecli serve` (server/metrics.py, built in a registry of
their own). Each lives between two markers in its page:

    <!-- generated: NAME (scripts/gen_docs.py) -->
    ...
    <!-- end generated: NAME -->

`python scripts/gen_docs.py` rewrites them (`make docs`); `--check` exits 1 naming the stale
ones (tests/unit/test_docs_tables.py runs it). The tables depend on the code only, never on
the machine: a default computed at run time (threads, dtype) is an option whose default is
None (or `show_default="..."`) and whose help text says what it will be.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from enum import Enum
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def families() -> str:
    from pagecli.models.registry import FAMILIES

    rows = [
        "| file | transformers architectures | GGUF `general.architecture` |",
        "| --- | --- | --- |",
    ]
    for cls in FAMILIES:
        module = cls.__module__.replace(".", "/") + ".py"
        archs = ", ".join(f"`{a}`" for a in cls.hf_architectures)
        archs += "".join(f", `{a}` (its language model)" for a in cls.multimodal_architectures)
        gguf = ", ".join(
            [f"`{a.name}`" for a in cls.gguf]
            + [f"`{name}` (with experts)" for name in cls.gguf_shared]
        )
        gguf = gguf or "(safetensors only)"
        rows.append(f"| `{module}` | {archs} | {gguf} |")
    return "\n".join(rows)


def block_formats() -> str:
    from pagecli_kernels.quant_formats import FORMATS

    names = ", ".join(f.upper() for f in FORMATS)
    return (
        f"GGUF block formats kept in the file's map and multiplied there: {names}; BF16 "
        "tensors stay there too, as bfloat16 rows (rows of whole 32-value blocks). A file's "
        "other tensor types that the `gguf` package reads (F16, F32, the other K- and "
        "I-quants) are dequantized to float32 at load."
    )


def tool_formats() -> str:
    from pagecli.server.tool_calls import _REGISTRY, FORMATS

    rows = ["| `--tool-call-parser` | file | tags |", "| --- | --- | --- |"]
    for name in FORMATS:
        cls = _REGISTRY[name]
        module = cls.__module__.replace(".", "/") + ".py"
        tags = ", ".join("`" + t.replace("|", "\\|") + "`" for t in cls.tags)  # in a table
        rows.append(f"| `{name}` | `{module}` | {tags} |")
    return "\n".join(rows)


# Which docs page holds each command's flags; a command missing here fails the tests.
FLAG_PAGES = {
    "chat": "docs/chat.md",
    "generate": "docs/generate.md",
    "serve": "docs/serve.md",
    "bench": "docs/bench.md",
    "blocks": "docs/display.md",
}


def cell(text: str) -> str:
    """Text as one table cell: one line, `|` escaped, `<` kept from reading as HTML outside
    code spans."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def cli_commands() -> dict:
    """The click commands of `pagecli`, by name, as Typer builds them."""
    import typer

    from pagecli.cli.app import app

    return dict(typer.main.get_command(app).commands)


def _default(param) -> str:
    """The default as `--help` shows it; blank where the help text says it (default None)."""
    if isinstance(param.show_default, str):
        return param.show_default
    value = param.default
    if not param.show_default or value is None:
        return ""
    if callable(value):
        return "(dynamic)"
    if param.is_flag and param.secondary_opts:
        return f"`{(param.opts if value else param.secondary_opts)[0]}`"
    if param.is_flag and value is False:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value.value if isinstance(value, Enum) else value}`"


def _flag_row(param, ctx) -> str:
    opts = sorted(param.opts, key=lambda o: len(o) - len(o.lstrip("-")))  # -m before --model
    spelled = ", ".join(f"`{o}`" for o in opts)
    if param.secondary_opts:
        spelled += " / " + ", ".join(f"`{o}`" for o in param.secondary_opts)
    value = "" if param.is_flag else param.display_type_rich(ctx)
    value = value.removeprefix("<").removesuffix(">").replace("|", "\\|")
    value = f"`{value}`" if value else ""
    meaning = param.help or ""
    envvars = [param.envvar] if isinstance(param.envvar, str) else param.envvar or []
    if envvars and param.show_envvar:
        meaning += " Env: " + ", ".join(f"`{e}`" for e in envvars) + "."
    if param.required:
        meaning += " Required."
    return f"| {spelled} | {value} | {_default(param)} | {cell(meaning)} |"


def flags(command: str) -> str:
    """The options of `pagecli COMMAND`, one table per help panel in `--help`'s order."""
    return flag_tables(cli_commands()[command])


def flag_tables(cmd) -> str:
    """The visible options of a Typer-built click command, one table per help panel."""
    import typer

    ctx = typer.Context(cmd, info_name=cmd.name)
    panels: dict[str, list] = {"Options": []}  # --help shows the unnamed panel first
    for param in cmd.params:
        if not param.hidden:
            panels.setdefault(param.rich_help_panel or "Options", []).append(param)
    blocks = []
    for panel, params in panels.items():
        if params:
            rows = [_flag_row(p, ctx) for p in params]
            header = ["| flag | value | default | meaning |", "| --- | --- | --- | --- |"]
            blocks.append(f"**{panel}**\n\n" + "\n".join(header + rows))
    return "\n\n".join(blocks)


def metrics() -> str:
    """The Prometheus families of `pagecli serve`'s /metrics, from a fresh ServerMetrics after
    one request and with an engine snapshot (the engine's families exist only with one)."""
    from pagecli.engine.stats import EngineStats
    from pagecli.server.metrics import ServerMetrics

    server = ServerMetrics("MODEL")
    server.observe_request(1, 1, ["stop"], ttft_s=0.1, itl_s=[0.1], e2e_s=0.1)
    zeros = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING}
    server.render(EngineStats(**zeros))
    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for family in server.registry.collect():
        labels = list(dict.fromkeys(k for s in family.samples for k in s.labels if k != "le"))
        name, kind = family.name, family.type
        if kind == "counter":
            name += "_total"
        if kind == "histogram":
            bounds = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
            finite = [b for b in bounds if b != "+Inf"]
            kind += f" (`_bucket`, `_sum`, `_count`; le {finite[0]} to {finite[-1]})"
        labelled = ", ".join(f"`{k}`" for k in labels)
        rows.append(f"| `{name}` | {kind} | {labelled} | {cell(family.documentation)} |")
    return "\n".join(rows)


REGIONS = {
    "families": ("docs/models.md", families),
    "block-formats": ("docs/models.md", block_formats),
    "tool-formats": ("docs/serve.md", tool_formats),
    "metrics": ("docs/serve.md", metrics),
    **{f"flags-{c}": (page, lambda c=c: flags(c)) for c, page in FLAG_PAGES.items()},
}


def region_re(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- generated: {re.escape(name)} \(scripts/gen_docs.py\) -->\n)(.*?)"
        rf"(<!-- end generated: {re.escape(name)} -->)",
        re.S,
    )


def render(text: str, name: str, body: str) -> str:
    pattern = region_re(name)
    if not pattern.search(text):
        raise SystemExit(f"gen_docs: the markers of {name!r} are missing")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a table is stale")
    args = ap.parse_args()
    stale = []
    for name, (page, make) in REGIONS.items():
        path = ROOT / page
        text = path.read_text()
        fresh = render(text, name, make())
        if fresh != text:
            stale.append(f"{page} ({name})")
            if not args.check:
                path.write_text(fresh)
    if args.check and stale:
        print("stale generated tables: " + ", ".join(stale) + " (run `make docs`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
