"""Errors the CLI reports as one `error: ...` line with exit code 2 (no traceback unless --debug)."""


class UsageError(Exception):
    """A mistake in the user's input: a flag, an environment variable, a config file, a data file.

    The message is one line that names the place, e.g. `x.toml: [sampling].top_p: must be in (0, 1], got 2`.
    """


class RunError(Exception):
    """A run that cannot go on for a reason outside the user's input (e.g. a tensor-parallel rank
    died): one `error: ...` line and exit code 1."""


def install_hint(extra: str) -> str:
    """How to install one of the package's extras: from the checkout when it is installed editable (pip's
    direct_url.json says so), else from the index."""
    import json
    from importlib.metadata import distributions
    from urllib.parse import unquote, urlparse

    for dist in distributions(name="dsv4cli"):     # an egg-info in the working directory may come first
        installed = json.loads(dist.read_text("direct_url.json") or "{}")
        if installed.get("dir_info", {}).get("editable"):
            return f"pip install -e '.[{extra}]' in {unquote(urlparse(installed['url']).path)}"
    return f"pip install 'dsv4cli[{extra}]'"
