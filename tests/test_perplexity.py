"""`dsv4 perplexity` end to end in subprocesses: the NLL of a plain full forward pass per window, saved logits
that resume after a kill, KL divergence against them, and bad input as one line with exit code 2."""
import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

from dsv4cli.model import load_model
from dsv4cli.perplexity import LogitsFile, windows
from dsv4cli.tokenizer import Tokenizer

TEXT = " ".join(f"Line {i}: the cat sat on the mat and looked at the {('sun', 'moon', 'sea')[i % 3]}."
               for i in range(40))


def dsv4(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dsv4cli", *args], capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(TEXT)
    return path


@torch.no_grad()
def reference_nll(model_dir, ctx: int, stride: int) -> tuple[float, int]:
    """The NLL a plain full forward pass over each window gives its scored tokens, and their count."""
    tok, model = Tokenizer.from_dir(model_dir), load_model(model_dir, "cpu", torch.float32)
    tokens = [tok.bos_id, *tok.encode(TEXT)]
    nll, count = 0.0, 0
    for w in windows(len(tokens), ctx, stride):
        ids = tokens[w.start:w.end]
        lp = model.forward(torch.tensor([ids])).log_softmax(-1)[0].double()
        rows = range(w.first - w.start - 1, w.end - w.start - 1)
        nll -= sum(lp[r, ids[r + 1]].item() for r in rows)
        count += len(rows)
    return nll, count


def test_windows_score_every_token_once():
    for n, ctx, stride in ((1000, 128, 128), (1000, 128, 50), (129, 128, 128), (5, 2048, 2048), (300, 64, 1)):
        scored = [p for w in windows(n, ctx, stride) for p in range(w.first, w.end)]
        if stride == ctx:
            assert scored == [p for p in range(1, n) if p % ctx]      # each window's first has no context
        else:
            assert scored == list(range(1, n))
        assert all(w.end - w.start <= ctx for w in windows(n, ctx, stride))


@pytest.mark.parametrize("ctx, stride", [(200, 200), (160, 60)])
def test_perplexity_is_the_full_forward_pass_nll(tiny_model_dir, text_file, ctx, stride):
    """Windows crossing the window (16), ratio-4 and ratio-128 blocks and the 160-token prefill budget, batched
    2 at a time, disjoint or overlapping: the NLL of a full forward pass over each window, within 1e-4
    relative at float32; ppl and its error follow from it; the text from a file or stdin."""
    stdin = stride < ctx            # one run reads the text from a file, the other from stdin (`-`)
    r = dsv4("perplexity", "-" if stdin else str(text_file), "--model", str(tiny_model_dir), "--dtype", "float32",
             "--ctx", str(ctx), "--stride", str(stride), "--max-batch", "2", "--json",
             input=TEXT if stdin else None)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    nll, count = reference_nll(tiny_model_dir, ctx, stride)
    assert got["tokens"] == count and abs(got["nll"] - nll) <= 1e-4 * abs(nll), (got["nll"], nll)
    assert math.isclose(got["ppl"], math.exp(nll / count), rel_tol=1e-4) and got["ppl_stderr"] > 0
    assert got["ctx"] == ctx and got["stride"] == stride and got["windows"] == len(windows(count + 1, ctx, stride))


def test_saved_logits_resume_and_kl_against_them(tiny_model_dir, text_file, tmp_path):
    """--save-logits killed mid-run and run again completes the file with each window once, as one
    uninterrupted run writes it; a run against its own saved logits has KL divergence 0, top-1 agreement 1 and
    Δppl 0; another model's run has a positive divergence."""
    args = ("--model", str(tiny_model_dir), "--dtype", "float32", "--ctx", "64", "--max-batch", "1")
    whole = tmp_path / "whole.logits"
    assert dsv4("perplexity", str(text_file), *args, "--save-logits", str(whole)).returncode == 0
    cut = tmp_path / "cut.logits"
    proc = subprocess.Popen([sys.executable, "-m", "dsv4cli", "perplexity", str(text_file), *args, "--save-logits",
                             str(cut)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while not (cut.exists() and len(LogitsFile.read(cut, "").records) >= 2) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with open(cut, "ab") as f:          # and a record cut short
        f.write(b"\x05\x00\x00\x00\x07\x00")
    assert dsv4("perplexity", str(text_file), *args, "--save-logits", str(cut)).returncode == 0
    a, b = LogitsFile.read(whole, ""), LogitsFile.read(cut, "")
    assert a.header == b.header and sorted(a.records) == sorted(b.records) == list(range(len(a.records)))
    assert all(a.records[w][1] == b.records[w][1] for w in a.records)          # the same top ids
    assert all(max(abs(x - y) for x, y in zip(a.records[w][2], b.records[w][2])) <= 1e-5 for w in a.records)
    assert cut.stat().st_size == whole.stat().st_size

    r = dsv4("perplexity", str(text_file), *args, "--kl-divergence", str(whole), "--json")
    assert r.returncode == 0, r.stderr
    same = json.loads(r.stdout)
    assert same["kl_max"] <= 1e-6 and same["top1_agreement"] == 1 and abs(same["delta_ppl"]) <= 1e-6 * same["ppl"]
    text = dsv4("perplexity", str(text_file), *args, "--kl-divergence", str(whole))
    assert "KL divergence vs" in text.stdout and "top-1 agreement 100.00%" in text.stdout
    bf16 = json.loads(dsv4("perplexity", str(text_file), *args[:2], "--dtype", "bfloat16", *args[4:],
                           "--kl-divergence", str(whole), "--json").stdout)
    assert 0 < bf16["kl_mean"] < 0.1 and bf16["kl_median"] <= bf16["kl_p90"] <= bf16["kl_p99"] <= bf16["kl_max"]


def test_bad_input_is_one_line_and_exit_2(tiny_model_dir, text_file, tmp_path):
    args = ("--model", str(tiny_model_dir), "--dtype", "float32")
    other = tmp_path / "other.txt"
    other.write_text("Another text altogether.")
    saved = tmp_path / "saved.logits"
    assert dsv4("perplexity", str(other), *args, "--ctx", "64", "--save-logits", str(saved)).returncode == 0
    not_logits = tmp_path / "x.logits"
    not_logits.write_text("hello\n")
    cases = [(("nope.txt",), "nope.txt"), ((str(text_file), "--ctx", "1"), "--ctx"),
             ((str(text_file), "--ctx", "64", "--stride", "65"), "--stride"),
             ((str(text_file), "--ctx", "4096"), "--ctx 4096: at most 4095"),
             ((str(text_file), "--kl-divergence", str(not_logits)), "not a logits file"),
             ((str(text_file), "--ctx", "64", "--kl-divergence", str(saved)), "another text"),
             ((str(text_file), "--ctx", "64", "--save-logits", str(saved)), "another run"),
             ((str(text_file), "--save-logits", str(saved), "--kl-divergence", str(saved)), "--save-logits")]
    for extra, says in cases:
        r = dsv4("perplexity", *extra, *args)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, (extra, r.stderr)
