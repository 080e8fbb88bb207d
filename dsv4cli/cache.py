"""Where dsv4cli keeps what it builds on this machine: the native kernels and the compiled steps."""
import os
from pathlib import Path


def user_cache_dir() -> Path:
    """dsv4cli's persistent cache (XDG)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4cli"
