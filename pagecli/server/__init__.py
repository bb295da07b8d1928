"""The OpenAI-compatible HTTP server of `pagecli serve` (FastAPI + uvicorn)."""
