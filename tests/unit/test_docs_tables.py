"""The tables docs/ takes from the code (scripts/gen_docs.py) are the code's: a family, block
format or tool-call format added without `make docs` fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_docs  # noqa: E402


@pytest.mark.parametrize("name", sorted(gen_docs.REGIONS))
def test_generated_tables_are_fresh(name):
    page, make = gen_docs.REGIONS[name]
    text = (ROOT / page).read_text()
    assert gen_docs.render(text, name, make()) == text, f"{page} ({name}): run `make docs`"


def test_the_check_fails_on_a_stale_table(tmp_path, monkeypatch):
    page, make = gen_docs.REGIONS["families"]
    text = (ROOT / page).read_text()
    stale = gen_docs.render(text, "families", "| file | gone |")
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
