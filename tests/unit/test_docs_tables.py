"""The tables docs/ takes from the code (scripts/gen_docs.py) are the code's: a family, block
format, tool-call format, command flag or server metric added without `make docs` fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_docs  # noqa: E402


@pytest.mark.parametrize("name", sorted(gen_docs.REGIONS))
def test_generated_tables_are_fresh(name):
    page, make = gen_docs.REGIONS[name]
    text = (ROOT / page).read_text()
    assert gen_docs.render(text, name, make()) == text, f"{page} ({name}): run `make docs`"


@pytest.mark.parametrize("name", ["families", "flags-serve", "metrics"])
def test_the_check_fails_on_a_stale_table(name, tmp_path, monkeypatch):
    page, make = gen_docs.REGIONS[name]
    text = (ROOT / page).read_text()
    stale = gen_docs.render(text, name, make().replace("|", "¦", 6))
    assert stale != text
    (tmp_path / "docs").mkdir()
    for other in {p for p, _ in gen_docs.REGIONS.values()}:
        (tmp_path / other).write_text((ROOT / other).read_text())
    (tmp_path / page).write_text(stale)
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["gen_docs.py", "--check"])
    assert gen_docs.main() == 1
    monkeypatch.setattr(sys, "argv", ["gen_docs.py"])
    assert gen_docs.main() == 0 and (tmp_path / page).read_text() == text  # rewritten fresh


def test_the_script_runs_as_make_docs_runs_it():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], capture_output=True
    )
    assert result.returncode == 0, result.stderr.decode()


def test_every_command_has_a_flags_table():
    assert set(gen_docs.cli_commands()) == set(gen_docs.FLAG_PAGES)


def test_a_flags_table_keeps_a_row_to_a_line_and_hidden_options_out():
    app = typer.Typer(add_completion=False)

    @app.command()
    def demo(
        mode: Annotated[str, typer.Option(help="One of a|b,\nsay <which>.")] = "a",
        threads: Annotated[
            Optional[int],
            typer.Option(help="Threads (default: the cores).", rich_help_panel="Engine"),
        ] = None,
        secret: Annotated[bool, typer.Option(hidden=True, help="Not for users.")] = False,
        cache: Annotated[bool, typer.Option("--cache/--no-cache", help="Reuse blocks.")] = True,
    ) -> None:
        """A command for the table."""

    table = gen_docs.flag_tables(typer.main.get_command(app))
    assert table.splitlines() == [
        "**Options**",
        "",
        "| flag | value | default | meaning |",
        "| --- | --- | --- | --- |",
        "| `--mode` | `str` | `a` | One of a\\|b, say &lt;which>. |",
        "| `--cache` / `--no-cache` |  | `--cache` | Reuse blocks. |",
        "",
        "**Engine**",
        "",
        "| flag | value | default | meaning |",
        "| --- | --- | --- | --- |",
        "| `--threads` | `int` |  | Threads (default: the cores). |",
    ]


def test_the_metrics_table_names_what_a_scrape_shows():
    rows = gen_docs.metrics().splitlines()[2:]
    names = [row.split("`")[1] for row in rows]
    assert "pagecli:num_requests_running" in names
    assert "pagecli:prompt_tokens_total" in names  # counters as exposed, with _total
    assert "pagecli:num_preemptions_total" in names
    assert any("`mode`" in row for row in rows if "num_preemptions" in row)
