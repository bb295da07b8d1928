"""The console script's entry point: a Ctrl-C while the commands are still being imported
(torch takes a second or two) ends quietly with exit code 130, like one at any later point."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    try:
        from pagecli.cli.app import main as run
    except KeyboardInterrupt:
        sys.exit(130)
    run(argv)


if __name__ == "__main__":  # python -X importtime -m pagecli.cli.entry --help
    main()
