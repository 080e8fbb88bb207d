"""--tp N on the CPU: gloo ranks started by the CLI; same logits and tokens as one process; a dead
rank ends the run with one line instead of a hang."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from test_fp8 import write_official
from tiny import tiny_config, tiny_dspark_config, write_checkpoint

from dsv4cli import parallel
from dsv4cli.model import ModelConfig, Transformer, load_model
from dsv4cli.model import model as model_module
from dsv4cli.model.footprint import SPLIT_NAMES, split_by_tp, tp_problem
from dsv4cli.model.model import TP_COUNTS

# 4 heads, 2 output groups, 4 indexer heads, 8 experts, vocab 256: all divisible by 2
CFG = tiny_config(index_n_heads=4)


def _rank(rank, world, port, path, out):
    torch.manual_seed(0)
    parallel.init_rank(rank, world, port, torch.device("cpu"))
    model = load_model(path, dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(1))
    logits, hidden = model(ids, return_hidden=True)
    mtp = model.mtp_forward(hidden, torch.roll(ids, -1, 1))
    if rank == 0:
        torch.save({"logits": logits, "drafts": mtp}, out)
    parallel.leave()


@pytest.mark.parametrize("layout", ["float", "release"])
def test_tp2_logits_match_tp1(tmp_path, layout):
    """Float weights, and the official release's held as stored: each rank its rows or columns of every FP8
    weight with the tiles covering them (wq_b's half starts inside a 128-row tile), and its FP4 experts."""
    (write_checkpoint if layout == "float" else write_official)(tmp_path / "m", CFG, seed=2)
    store = parallel.rendezvous()
    mp.start_processes(_rank, args=(2, store.port, tmp_path / "m", tmp_path / "tp2.pt"), nprocs=2,
                       start_method="spawn")
    got = torch.load(tmp_path / "tp2.pt")
    model = load_model(tmp_path / "m", dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(1))
    logits, hidden = model(ids, return_hidden=True)
    mtp = model.mtp_forward(hidden, torch.roll(ids, -1, 1))
    for name, ref in (("logits", logits), ("drafts", mtp)):
        err = ((got[name] - ref).abs().max() / ref.abs().max()).item()
        print(f"tp2 vs tp1 {name}: max relative error {err:.1e}")
        assert err < 1e-5
        assert torch.equal(got[name].argmax(-1), ref.argmax(-1))


def dsv4(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dsv4cli", *args], capture_output=True, text=True,
                          timeout=300, check=False, **kw)


def test_tp2_greedy_tokens_match(tiny_model_dir):
    for mtp in ("0", "1"):
        outs = []
        for tp in ("1", "2"):
            r = dsv4("generate", "--model", str(tiny_model_dir), "--prompt", "Tell me a story.", "-n", "12",
                     "--temperature", "0", "--ignore-eos", "--drafts", mtp, "--tp", tp, "--json")
            assert r.returncode == 0, r.stderr
            outs.append(r.stdout.split('"token_ids": ')[1].split("]")[0])
        assert outs[0] == outs[1], f"mtp {mtp}"


def test_bench_resizes_every_rank(tiny_model_dir):
    """bench swaps engines (batch sizes, MTP depths) mid-run; every rank must follow."""
    r = dsv4("bench", "--model", str(tiny_model_dir), "--tp", "2", "--depths", "1", "--batches", "1,2",
             "--prompts", "short", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"]
    assert [(x["batch"], x["drafts"]) for x in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_tp_that_does_not_divide_is_refused(tiny_model_dir):
    r = dsv4("generate", "--model", str(tiny_model_dir), "--prompt", "x", "--tp", "3")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--tp 3" in r.stderr and "Traceback" not in r.stderr


def test_what_tp_splits_is_what_the_modules_tag(monkeypatch):
    """The model built for each of 2 ranks against the whole one: the tensors the ranks hold in parts (rows,
    columns, or the routed experts each its own) are those the modules' `tp_split` tags, by which the footprint
    counts a card's bytes; every tag names some of them; `tp_problem` checks every count of TP_COUNTS, so each
    is one the tags split."""
    def tensors(cfg, rank, ranks):
        monkeypatch.setattr(model_module, "world", lambda: (rank, ranks))
        with torch.device("meta"):
            model = Transformer(cfg)
        return {name: t.numel() for name, t in [*model.named_parameters(), *model.named_buffers()]}

    split_parts = set()
    mtp, dspark = ModelConfig.from_dict(CFG), ModelConfig.from_dict(tiny_dspark_config(index_n_heads=4))
    for cfg in (mtp, dspark, replace(dspark, dspark_vocab_copies=True)):
        whole, ranks = tensors(cfg, 0, 1), [tensors(cfg, rank, 2) for rank in (0, 1)]
        split = {name for name, n in whole.items() if any(held.get(name) != n for held in ranks)}
        assert split == {name for name in whole if split_by_tp(name)}
        assert all(sum(held.get(name, 0) for held in ranks) == whole[name] for name in split)
        assert all(2 * sum(held.get(name, 0) for name in split) == sum(whole[name] for name in split)
                   for held in ranks)                    # each card half of them, as the footprint counts
        split_parts |= {part for name in split for part in name.split(".")}
    assert not SPLIT_NAMES - split_parts           # a tag that names no split tensor
    for count, what in TP_COUNTS.items():
        odd = getattr(mtp, count) + 1
        assert tp_problem(replace(mtp, **{count: odd}), 2) == f"does not divide the {odd} {what}"


def children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except OSError:
                pass
    return kids


def test_killed_rank_ends_the_run(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "dsv4cli", "generate", "--model", str(tiny_model_dir),
                             "--prompt", "x", "-n", "100000", "--ignore-eos", "--tp", "2", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        deadline = time.time() + 120
        while time.time() < deadline and not (proc.stdout.read(1) or ""):   # wait for decoding
            time.sleep(0.2)
        workers = [p for p in children(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert workers, "no rank process found"
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.time()
        rc = proc.wait(timeout=30)
        assert time.time() - t0 < 10
        err = proc.stderr.read()
        assert rc == 1 and "rank 1 exited" in err and "Traceback" not in err
    finally:
        proc.kill()


def test_a_dead_rank_is_named_with_its_exit_code():
    """What both the step that fails and the watchdog say (`parallel.dead_rank`)."""
    running, killed = SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=-9)
    assert parallel.dead_rank([running, running]) is None
    assert parallel.dead_rank([running, killed]) == "tensor-parallel rank 2 exited with code -9; stopping all ranks"


def rank_processes(pid: int) -> list[int]:
    return [p for p in children(pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def running(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_serve_ends_when_a_rank_dies(tiny_model_dir):
    """serve --tp 2 with a stream open: rank 1 killed, the server exits with one line, no rank left."""
    import httpx2 as httpx

    proc = subprocess.Popen([sys.executable, "-m", "dsv4cli", "serve", "--port", "0", "--model", str(tiny_model_dir),
                             "--tp", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split(" on ")[1].split()[0]
        workers = rank_processes(proc.pid)
        body = {"prompt": "x", "max_tokens": 100000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/completions", json=body, timeout=60) as r:
            next(r.iter_lines())
            os.kill(workers[0], signal.SIGKILL)
            t0 = time.time()
            rc = proc.wait(timeout=30)
        assert time.time() - t0 < 10
        err = proc.stderr.read()
        assert rc == 1 and "rank 1 exited" in err and "Traceback" not in err, err
        assert not any(map(running, workers))
    finally:
        proc.kill()


def test_killed_rank_0_takes_the_other_ranks_with_it(tiny_model_dir):
    """Rank 0 killed while the ranks start up (it sends no stop then): rank 1 once waited 10 minutes for it."""
    proc = subprocess.Popen([sys.executable, "-m", "dsv4cli", "serve", "--port", "0", "--model", str(tiny_model_dir),
                             "--tp", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not (workers := rank_processes(proc.pid)) and time.time() < deadline:
            time.sleep(0.1)
        assert workers, "no rank process found"
        time.sleep(1)                                   # it is loading
        proc.kill()
        proc.wait()
        t0 = time.time()
        while any(map(running, workers)) and time.time() - t0 < 30:
            time.sleep(0.1)
        assert not any(map(running, workers)) and time.time() - t0 < 10
    finally:
        for pid in workers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_tp2_perplexity_matches_tp1(tiny_model_dir, tmp_path):
    """Scored prefill chunks under --tp 2 (the vocabulary split, logits all-gathered): the NLL of one process."""
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a cat who liked the sun. " * 12)
    runs = []
    for tp in ("1", "2"):
        r = dsv4("perplexity", str(text), "--model", str(tiny_model_dir), "--dtype", "float32", "--ctx", "200",
                 "--tp", tp, "--json")
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout))
    assert runs[0]["tokens"] == runs[1]["tokens"] and abs(runs[0]["nll"] - runs[1]["nll"]) <= 1e-5 * runs[0]["nll"]
