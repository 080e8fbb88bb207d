import gc
import os
import sys
from pathlib import Path

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine oversubscribed
# threads make every small op wait; subprocesses (the CLI under test) inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# A cold compile of the decode step takes minutes here: tests run eager unless they compile on purpose
# (tests/test_compile.py); subprocesses inherit it.
os.environ.setdefault("DSV4_COMPILE", "off")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # `scripts` (corpus, tokenizer training) for tests


def pytest_sessionfinish(session):
    """Free a worker's garbage (compiled graphs, models) before pytest-xdist reports the worker finished:
    pytest collects it again at its exit, and execnet gives that exit 5 s before it SIGINTs the worker, whose
    KeyboardInterrupt then lands in some weakref callback and prints a traceback under a green run."""
    torch._dynamo.reset()
    gc.collect()


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE with the DSV4 special tokens, trained on a little corpus (vocab 300)."""
    from scripts.corpus import build_corpus
    from scripts.train_tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(build_corpus(0, 200, 50), path, vocab_size=300)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, small_tokenizer_dir):
    """A random tiny DeepSeek V4 checkpoint (official float layout, with MTP) plus tokenizer files:
    a complete model directory for end-to-end CLI tests that don't need a trained model."""
    import json
    import shutil

    from tiny import tiny_config, write_checkpoint

    from dsv4cli.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("model")
    vocab = Tokenizer.from_dir(small_tokenizer_dir).vocab_size
    write_checkpoint(path, tiny_config(vocab_size=vocab), seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(small_tokenizer_dir / name, path / name)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1, "temperature": 0.0}))
    return path


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    """The small tokenizer (modules with another tokenizer define their own `tok`)."""
    from dsv4cli.tokenizer import Tokenizer

    return Tokenizer.from_dir(small_tokenizer_dir)


@pytest.fixture(scope="module")
def model(tok, tmp_path_factory):
    """A random tiny float model with every attention kind and MTP, for engine tests."""
    from tiny import tiny_config, write_checkpoint

    from dsv4cli.model import load_model

    path = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(path, tiny_config(vocab_size=tok.vocab_size), seed=3)
    return load_model(path, dtype=torch.float32)
