"""A --against target whose module exits while importing (tests/test_cli.py)."""
import sys

sys.exit(3)
