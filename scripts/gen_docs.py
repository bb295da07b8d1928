"""The tables of docs/ that code knows: the model families (from models/registry.py), the
GGUF block formats kept in memory (pagecli_kernels/quant_formats.py) and the tool-call formats
(server/tool_calls). Each lives between two markers in its page:

    <!-- generated: NAME (scripts/gen_docs.py) -->
    ...
    <!-- end generated: NAME -->

`python scripts/gen_docs.py` rewrites them (`make docs`); `--check` exits 1 naming the stale
ones (tests/unit/test_docs_tables.py runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
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
        gguf = ", ".join(f"`{a.name}`" for a in cls.gguf) or "(safetensors only)"
        rows.append(f"| `{module}` | {archs} | {gguf} |")
    return "\n".join(rows)


def block_formats() -> str:
    from pagecli_kernels.quant_formats import FORMATS

    names = ", ".join(f.upper() for f in FORMATS)
    return (
        f"GGUF block formats kept in the file's map and multiplied there: {names}. A file's "
        "other tensor types that the `gguf` package reads (F16, BF16, F32, the other K- and "
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


REGIONS = {
    "families": ("docs/models.md", families),
    "block-formats": ("docs/models.md", block_formats),
    "tool-formats": ("docs/serve.md", tool_formats),
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
