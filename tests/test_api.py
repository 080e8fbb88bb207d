"""`dsv4cli.load`: the CLI's engine for Python code, and the README's example that uses it."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv4cli
from dsv4cli.encoding import encode_messages
from dsv4cli.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def test_load_makes_the_clis_choices():
    """torch's default (every core) made the README's example 12-16x slower than the CLI on the bundled model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = dsv4cli.load(drafts=2, max_seq_len=512)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert (engine.drafts, engine.max_seq_len, engine.device.type) == (2, 512, "cpu")     # 2 of DSpark's 5 verified
    ids = engine.tok.encode(encode_messages([{"role": "user", "content": "What is 2 plus 3?"}]))
    seq = engine.submit(ids, dsv4cli.SamplingParams(temperature=0, max_tokens=8))
    while engine.has_work():
        engine.step()
    cli = subprocess.run([sys.executable, "-m", "dsv4cli", "generate", "-p", "What is 2 plus 3?", "-n", "8",
                          "--temperature", "0", "--json"], capture_output=True, text=True, check=True)
    assert seq.output_ids == json.loads(cli.stdout)["token_ids"]


def test_load_refuses_what_the_cli_refuses():
    with pytest.raises(TypeError, match="unknown settings temperature"):
        dsv4cli.load(temperature=0)
    with pytest.raises(UsageError, match="--max-batch: must be >= 1, got 0"):
        dsv4cli.load(max_batch=0)
    with pytest.raises(UsageError, match="no such model directory"):
        dsv4cli.load("/nonexistent/model")


def test_the_readme_example_runs():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Python API"):readme.index("## Configuration")]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}    # torch's own default, as a user has
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time") and "'tokens_per_s'" in r.stdout
