"""The OpenAI API as pagecli speaks it: request models and their mapping (protocol.py)."""
