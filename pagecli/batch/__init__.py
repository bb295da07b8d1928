"""The logic of `pagecli generate`: JSONL records and OpenAI batch lines in (jsonl.py,
fields.py, openai_batch.py, files.py), the run on any backend (run.py), progress on stderr."""
