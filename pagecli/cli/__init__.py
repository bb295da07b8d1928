"""The `pagecli` command line: app.py is the Typer root, one module per command."""

import os

# Before transformers or huggingface-hub is imported: keep their progress bars and warnings
# off stderr (`--verbose` turns them back on).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
