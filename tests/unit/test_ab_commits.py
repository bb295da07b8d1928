"""benchmarks/ab_commits.py runs each side from its own checkout's code, wherever the script
is started from (`python -c` puts the working directory first on sys.path, before PYTHONPATH:
from this repository's root both sides would run this checkout)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def test_a_side_imports_its_own_checkout(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import ab_commits
    finally:
        sys.path.pop(0)
    other = tmp_path / "other"
    (other / "pagecli" / "cli").mkdir(parents=True)
    (other / "pagecli" / "__init__.py").write_text("")
    (other / "pagecli" / "cli" / "__init__.py").write_text("")
    (other / "pagecli" / "cli" / "entry.py").write_text(
        "import pagecli, sys\n\ndef main():\n    print(pagecli.__file__, *sys.argv[1:])\n"
    )
    monkeypatch.chdir(BENCHMARKS.parent)  # the repository's root, as the script is run
    assert os.path.isdir("pagecli")
    out = ab_commits.run_side(other, ["bench", "--json"]).split()
    assert out == [str(other / "pagecli" / "__init__.py"), "bench", "--json"]
