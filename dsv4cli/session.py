"""From resolved settings to a ready engine: device, dtype, model, tokenizer, sampling defaults."""
import torch

from dsv4cli import platforms
from dsv4cli.config import Settings
from dsv4cli.engine import Engine, SamplingParams
from dsv4cli.errors import UsageError
from dsv4cli.model import ConfigError, LoadError, ModelConfig, load_model
from dsv4cli.tokenizer import Tokenizer


def pick_device(name: str) -> torch.device:
    try:
        return platforms.pick(name).device()
    except LookupError as e:
        raise UsageError(str(e)) from None


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    return getattr(torch, platforms.for_device(device).default_dtype if name == "auto" else name)


def sampling_params(s: Settings) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, seed=s.seed, max_tokens=s.max_tokens,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)


def check_tp(s: Settings) -> None:
    """Refuse a --tp that does not divide what the ranks split."""
    path = s.model_dir / "config.json"
    try:
        cfg = ModelConfig.from_file(path)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for what, n in (("attention heads", cfg.n_heads), ("output groups", cfg.o_groups),
                    ("indexer heads", cfg.index_n_heads), ("routed experts", cfg.n_routed_experts),
                    ("vocabulary rows", cfg.vocab_size)):
        if n % s.tp:
            raise UsageError(f"--tp {s.tp}: does not divide the {n} {what} of {path.parent}")


def build_engine(s: Settings, device: torch.device) -> Engine:
    """This process's engine: tokenizer, model (its tensor-parallel slice when in a group), state."""
    path = s.model_dir
    try:
        tokenizer = Tokenizer.from_dir(path)
        model = load_model(path, device=device, dtype=pick_dtype(s.dtype, device))
    except (LoadError, ValueError) as e:
        raise UsageError(str(e)) from None
    if s.mtp and not model.cfg.n_mtp_layers:
        raise UsageError(f"{path}: the checkpoint has no MTP layer; use --mtp 0")
    # a chat turn resumes the previous turn's state; batch and generate prefill every prompt afresh
    return Engine(model, tokenizer, max_batch=s.max_batch, max_seq_len=s.max_seq_len, mtp=s.mtp,
                  reuse_prefix=s.mode == "chat")


def load_engine(s: Settings):
    """The engine the settings describe; with --tp N, rank 0's view of N cooperating ranks."""
    device = pick_device(s.device)
    if s.tp == 1:
        return build_engine(s, device)
    check_tp(s)
    from dsv4cli import parallel
    return parallel.launch_leader(s, device, lambda dev: build_engine(s, dev))
