"""dsv4cli: terminal inference for DeepSeek V4 Flash."""
import warnings

# torch warns at import when numpy is absent; nothing here uses numpy, so a fresh install stays quiet.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def __getattr__(name: str):
    """`dsv4cli.load` and `dsv4cli.SamplingParams`, imported on first use: the CLI imports this package,
    and `dsv4 --help` must not wait for torch."""
    if name == "load":
        from dsv4cli.api import load
        return load
    if name == "SamplingParams":
        from dsv4cli.engine import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'dsv4cli' has no attribute {name!r}")
