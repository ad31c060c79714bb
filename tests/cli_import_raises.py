"""A --against target whose module fails while importing (tests/test_cli.py)."""
raise RuntimeError("boom at import")
