"""Regenerate completions/ (bash, zsh, fish) from the Typer app: `make completions`."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagecli.cli.app import app
from pagecli.cli.completions import render_all

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "completions", help="target folder")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render_all(app).items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
