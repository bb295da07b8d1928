"""`pagecli blocks --demo`: run a short built-in workload and show the block map at its
busiest moment (on stdout, or as SVG with `--svg FILE` for the README)."""

from __future__ import annotations

import dataclasses
import io
import random
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from pagecli.cli.display import LiveDisplay, map_width_for, render
from pagecli.cli.options import CliError, VerboseOption, engine_options, load_llm, set_verbose
from pagecli.config import EngineConfig
from pagecli.engine.stats import EngineStats
from pagecli.sampling_params import SamplingParams

DEMO_KV_BLOCKS = 256  # small enough that every cell is one block
SVG_WIDTH = 120


@engine_options
def blocks(
    *,
    demo: Annotated[
        bool, typer.Option("--demo", help="Run a short built-in workload and show its map.")
    ] = False,
    svg: Annotated[
        Optional[Path],
        typer.Option(
            "--svg",
            help="Also write the map as an SVG picture to FILE.",
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    display: Annotated[
        Optional[bool],
        typer.Option(
            "--display/--no-display",
            show_default=False,
            help="Animate the map on stderr while the demo runs (default: on a terminal).",
        ),
    ] = None,
    verbose: VerboseOption = False,
    engine_config: EngineConfig,
) -> None:
    """Show the KV block map: free, in use, shared and cached-free blocks, and the numbers."""
    set_verbose(verbose)
    if not demo:
        raise CliError(
            "blocks needs a workload: use --demo (the map is also live in `generate --display`, "
            "`bench --display` and chat's /blocks)",
            exit_code=2,
        )
    if engine_config.num_kv_blocks is None:
        engine_config = dataclasses.replace(engine_config, num_kv_blocks=DEMO_KV_BLOCKS)
    llm = load_llm(engine_config)
    show = display if display is not None else sys.stderr.isatty()
    with LiveDisplay(enabled=show) as live:
        stats = run_demo(llm, lambda: live.update(llm.engine))
    console = Console(soft_wrap=False)
    console.print(render(stats, map_width_for(console)))
    if svg is not None:
        write_svg(stats, svg)


def interest(stats: EngineStats) -> tuple[int, int]:
    """How much a snapshot shows: distinct states present, then blocks in use."""
    return len(set(stats.block_states)), stats.blocks_in_use


def run_demo(llm, refresh) -> EngineStats:
    """Two finished requests (their blocks stay cached), then five requests reusing one's
    system prompt, one with two samples (copy-on-write); returns the busiest snapshot."""
    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randint(100, vocab - 100) for _ in range(n)]

    def params(max_tokens: int, n: int = 1) -> SamplingParams:
        return SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=1)

    system = ids(64)
    best: Optional[EngineStats] = None

    def run(requests: list[tuple[list[int], SamplingParams]], tag: str) -> None:
        nonlocal best
        for i, (prompt, p) in enumerate(requests):
            engine.add_request(f"demo-{tag}-{i}", prompt, p)
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.stats()
            if best is None or interest(stats) >= interest(best):
                best = stats
            refresh()

    # Requests admitted in the same step cannot share blocks that are not computed yet: a
    # first request computes the system prompt, whose blocks then stay cached.
    run([(ids(120), params(1)), (system + ids(10), params(1))], "earlier")
    later = [(system + ids(rng.randint(10, 40)), params(rng.randint(3, 5))) for _ in range(4)]
    later.append((system + ids(20), params(5, n=2)))
    later.append((ids(40), params(5)))
    run(later, "shared")
    return best


def write_svg(stats: EngineStats, path: Path) -> None:
    console = Console(
        record=True,
        width=SVG_WIDTH,
        file=io.StringIO(),
        force_terminal=True,
        color_system="truecolor",
    )
    console.print(render(stats))
    try:
        path.write_text(console.export_svg(title="pagecli blocks --demo"))
    except OSError as exc:
        raise CliError(f"{path}: cannot write the SVG ({exc.strerror})", exit_code=2) from None
    print(f"pagecli: wrote {path}", file=sys.stderr)
