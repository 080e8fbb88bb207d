"""Offline JSONL batch generation: the `dsv4 batch` verb (command.py), its loop (runner.py),
request lines in (requests.py) and result lines out (output.py)."""
