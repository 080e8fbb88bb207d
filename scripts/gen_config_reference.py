"""Rewrite the config reference table in README.md from the settings spec (dsv4cli/config.py)."""

import re
from pathlib import Path

from dsv4cli.config import reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"

text = README.read_text(encoding="utf-8")
if START not in text or END not in text:
    raise SystemExit(f"README.md lacks the {START.strip()} ... {END} markers")
new = re.sub(f"{START}.*?{END}", lambda _: f"{START}{reference_markdown()}{END}", text, flags=re.DOTALL)
if new == text:
    print("README.md config reference is up to date")
else:
    README.write_text(new, encoding="utf-8")
    print("README.md config reference rewritten")
