"""Model ids (`deepseek-ai/DeepSeek-V4-Flash`) -> directories in the local Hugging Face or ModelScope cache.

Offline only: nothing here downloads. Hugging Face ids are looked up with huggingface_hub (an optional
dependency, `pip install -e '.[hub]'`), which knows HF_HOME / HF_HUB_CACHE and the refs a snapshot is
under; the ModelScope cache is a plain tree (`$MODELSCOPE_CACHE/models/org/name`, by default under
~/.cache/modelscope/hub), read directly.
"""
import os
import re
from pathlib import Path

from dsv4cli.errors import UsageError, install_hint

MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_model_id(value: str) -> bool:
    """`org/name` and nothing more: no leading ./ or /, no ~, one slash."""
    return bool(MODEL_ID.fullmatch(value)) and ".." not in value


def hf_snapshot(model_id: str) -> Path | None:
    """The cached snapshot of a Hugging Face model, without reaching the network; None when absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def modelscope_dir(model_id: str) -> Path | None:
    root = modelscope_root()
    for path in (root / "models" / model_id, root / model_id):   # newer and older modelscope layouts
        if (path / "config.json").is_file():
            return path
    return None


def modelscope_root() -> Path:
    return Path(os.environ.get("MODELSCOPE_CACHE") or Path.home() / ".cache" / "modelscope" / "hub")


def find_cached(model_id: str) -> Path | None:
    """The local directory of a model id in the Hugging Face cache, else the ModelScope cache, or None."""
    try:
        found = hf_snapshot(model_id)
    except ImportError:
        found = None
    return found or modelscope_dir(model_id)


def resolve_model(value: str) -> str:
    """A model setting as a directory: a model id that is no path and is in a local cache becomes the cached
    directory; anything else stays as given."""
    if not Path(value).exists() and is_model_id(value) and (cached := find_cached(value)):
        return str(cached)
    return value


def model_name(model_dir: Path) -> str:
    """What results and banners call a model: its id when the directory is a hub cache's copy (Hugging Face's
    `models--org--name/snapshots/REVISION`, ModelScope's `models/org/name`), else the directory's name."""
    snapshots, repo = model_dir.parent, model_dir.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--"):
        return repo.name.removeprefix("models--").replace("--", "/")   # a repo id never holds "--"
    root = modelscope_root()
    if repo.absolute() in (root.absolute() / "models", root.absolute()):
        return f"{snapshots.name}/{model_dir.name}"
    return model_dir.name


def missing_model(value: str) -> UsageError:
    """Why `value` names no model directory, with how to get one when it looks like a model id."""
    if not is_model_id(value) or Path(value).exists():
        return UsageError(f"{value}: no such model directory" if not Path(value).exists() else
                          f"{value}: not a directory; give the model's directory")
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        return UsageError(f"{value}: no such directory, and not in the ModelScope cache; to look up Hugging Face "
                          f"ids install huggingface_hub ({install_hint('hub')})")
    return UsageError(f"{value}: no such directory, and not in the local Hugging Face or ModelScope cache; download "
                      f"it with `hf download {value}` or `modelscope download --model {value}`")
