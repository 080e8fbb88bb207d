"""The compiled decode step (torch.compile) against eager, its oracle: the same greedy tokens, no graph
breaks (the step compiles as one graph or fails), no recompiles in steady state, few kernels per layer."""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest
import torch
from tiny import random_model, tiny_config, write_checkpoint
from torch._dynamo.utils import counters as dynamo_counters

from dsv4cli import platforms
from dsv4cli.bench import kernel_calls
from dsv4cli.config import resolve
from dsv4cli.engine import Engine, EngineOptions, SamplingParams, compiled
from dsv4cli.engine.runner import ChunkKey, DraftPlan, StepKey
from dsv4cli.kernels import native
from dsv4cli.loading import BATCH_COMPILE_TOKENS, LONG_RUNNING, choose_compile, load_engine
from dsv4cli.model.model import PackedWeight
from dsv4cli.model.quant import quantize_model, release_model
from dsv4cli.tokenizer import Tokenizer

COMPILER = pytest.mark.skipif(platforms.get("cpu").compile_unavailable_reason() is not None,
                              reason="no C++ compiler")


@COMPILER
def test_compiled_step_gives_the_eager_tokens(small_tokenizer_dir, tmp_path, monkeypatch):
    """Every weight form in one graph: the MTP layer in the release's FP8/FP4 (their ops, its experts routed on the
    host), the first layer's experts stacked (what `prepare` does with small
    unpacked experts: grouped GEMMs in the graph), the second layer's linears packed for the native GEMMs
    (their custom ops) and its experts routed on the host from a fused-kernel table (one opaque op), as
    `prepare` leaves big ones; without the native kernels, its linears packed for the AVX2 ops. The compiled
    step is saved without unpacking a weight, and a new engine loads it. Prefill chunks compile too, padded
    to a bucket: both prompts' chunks (slots 0 and 1) run one graph."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))      # a cold cache: this test compiles
    # small enough to compile in about a minute on one core: a CSA and an HCA layer, a short Sinkhorn
    cfg = tiny_config(num_hidden_layers=2, compress_ratios=[4, 128, 0], hc_sinkhorn_iters=3,
                      vocab_size=Tokenizer.from_dir(small_tokenizer_dir).vocab_size)
    model = random_model(cfg, seed=3)
    release_model(model.mtp)      # the MTP layer as the official release holds it: FP8 and FP4 read as stored
    model = quantize_model(model).prepare()      # the trunk W8A8: the int8 GEMMs compile too
    assert all(layer.ffn.stack is not None for layer in model.layers)
    assert model.mtp[0].ffn.stack is None and model.mtp[0].attn.wq_a.format == "fp8"   # experts read in place
    unpacked = []      # `state_dict()` unpacks: a full extra copy of every packed weight
    if native.available() or native.avx2_available():
        # the second layer's linears in the native GEMMs' layouts, or the AVX2 ops': their ops in the graph
        monkeypatch.setattr(model.layers[1].ffn.ops, "PACK_MIN_BYTES", 0)
        packed = [m for m in model.layers[1].modules() if isinstance(m, PackedWeight)
                  and m.weight.shape[0] % native.BLOCK == 0 and (m.pack() or m.packed is not None)]
        int8 = torch.uint8 if native.available() else torch.int8
        assert {m.packed.dtype for m in packed} == {int8, torch.float32}
        if native.available():
            moe = model.layers[1].ffn
            moe.prepare_experts(on_host=True)
            assert moe.stack is None and moe.table is not None and moe.table.shared
        for unpack in (native.unpack_int8 if native.available() else native.unpack_pairs, native.unpack_float):
            monkeypatch.setattr(native, unpack.__name__, lambda packed, f=unpack: unpacked.append(f) or f(packed))
    tok = Tokenizer.from_dir(small_tokenizer_dir)
    prompts = [[5 + i % 40 for i in range(n)] for n in (9, 14)]      # one chunk bucket: 16 rows
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def run(engine):
        return [s.output_ids for s in engine.generate(prompts, params)]

    with torch.no_grad():
        eager = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=512, drafts=2))
        want = run(eager)
        engine = eager.resized(2, 2, compile=True)
        assert run(engine) == want
        assert list(engine.compiled.ready) == [CHUNK, STEP]
        assert run(engine) == want                       # steady state: the same graphs, no recompile
        assert engine.compiled.recompiles == 0 and engine.compiled.eager_steps == 0
        assert engine.compiled.built[STEP][0] == engine.compiled.built[CHUNK][0] == "compiled"
        assert len(list(compiled.steps_dir().iterdir())) == 2

        # a later launch loads the saved steps (its first step of each key waits for the load)
        later = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=512, drafts=2, compile=True))
        assert later.compiled.status == "eager"
        assert run(later) == want
        assert later.compiled.built[STEP][0] == later.compiled.built[CHUNK][0] == "loaded"
        assert later.compiled.eager_steps == 0 and later.compiled.recompiles == 0
        assert later.compiled.status == "compiled"
    assert not unpacked
    # the trunk's layers, the MTP layer twice (verify + one chained draft) and sampling, in few kernels;
    # a chunk runs the trunk and the MTP layer once (178 calls with int8 GEMMs, 190 with widened ones, 194
    # with the AVX2 pair GEMMs on this machine)
    assert 0 < kernel_calls(engine.compiled.sources[STEP]) <= 66 * (cfg["num_hidden_layers"] + 2)
    assert 0 < kernel_calls(engine.compiled.sources[CHUNK]) <= 66 * (cfg["num_hidden_layers"] + 1)


@COMPILER
def test_a_compiled_scored_chunk_gives_the_eager_prompt_logprobs(small_tokenizer_dir, tmp_path, monkeypatch):
    """A scored prompt (prompt_logprobs and score_ids, nothing generated) runs one compiled chunk graph whose
    scores are eager's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = tiny_config(num_hidden_layers=2, compress_ratios=[4, 128, 0], hc_sinkhorn_iters=3,
                      vocab_size=Tokenizer.from_dir(small_tokenizer_dir).vocab_size)
    model, tok = random_model(cfg, seed=4).prepare(), Tokenizer.from_dir(small_tokenizer_dir)
    prompt = [5 + i % 40 for i in range(14)]
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3, score_ids=[[7, 9]] * len(prompt))
    with torch.no_grad():
        eager = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=512, drafts=0))
        want = eager.generate([prompt], params)[0].prompt_logprobs
        engine = eager.resized(1, 0, compile=True)
        got = engine.generate([prompt], params)[0].prompt_logprobs
    assert list(engine.compiled.ready) == [StepKey(chunks=(ChunkKey(16, 512, True, True, 2),))]
    assert engine.compiled.eager_steps == 0 and [e.token for e in got] == prompt
    for a, b in zip(got[1:], want[1:]):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert max(abs(x - y) for x, y in zip([a.logprob, *a.given], [b.logprob, *b.given])) <= 1e-5


def poll_until(condition, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def reaped_while_idle(pid: int, timeout: float = 600) -> bool:
    """Whether a child process, once it ends, is reaped within seconds (gone from /proc, not a zombie; 15 s:
    a reaper thread waits on it, but a machine busy with other test runs can keep it off a core)."""
    zombie_since, deadline = None, time.time() + timeout
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        zombie_since = (zombie_since or time.time()) if state == "Z" else None
        if zombie_since and time.time() - zombie_since > 15:
            return False
        time.sleep(0.1)
    return False


STEP = StepKey(batch=2, context=512, plan=DraftPlan(drafts=2))   # decode rows of batch 2 verifying 2 drafts, greedy
CHUNK = StepKey(chunks=(ChunkKey(16, 512, True),))    # a prompt's last chunk, 16 rows, greedy


def settings_for(model_dir, **flags):
    return resolve(flags={"model": str(model_dir), "compile": "on", **flags}, env={})[0]


@COMPILER
def test_a_background_compile_runs_in_a_process_of_its_own(small_tokenizer_dir, tmp_path, monkeypatch, capfd):
    """Where the model can be loaded again, a process of its own compiles and saves the step: this one
    only loads it, so its eager steps keep the GIL meanwhile. The tokens stay the eager ones."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    path = tmp_path / "model"       # one window-only layer and no MTP: a short compile
    vocab = Tokenizer.from_dir(small_tokenizer_dir).vocab_size
    write_checkpoint(path, tiny_config(num_hidden_layers=1, num_nextn_predict_layers=0, compress_ratios=[0],
                                       hc_sinkhorn_iters=2, vocab_size=vocab))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(small_tokenizer_dir / name, path / name)
    prompts = [[5 + i % 40 for i in range(n)] for n in (20, 30)]     # one chunk bucket: 32 rows
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(engine):
        return [s.output_ids for s in engine.generate(prompts, params)]

    want = run(load_engine(settings_for(path, compile="off", drafts=0, max_batch=2, max_seq_len=512), "serve"))
    graphs = dict(dynamo_counters["stats"])
    engine = load_engine(settings_for(path, drafts=0, max_batch=2, max_seq_len=512), "serve")
    assert engine.reload is not None and engine.compiled.remake is not None
    assert run(engine) == want and engine.compiled.eager_steps > 0
    assert engine.compiled.status == "eager, compiling"      # a compile of ~40 s outlasts 24 eager tokens
    child = engine.compiled.apart[1]
    assert os.getpgid(child.pid) == child.pid != os.getpgid(0)  # a Ctrl-C at chat's terminal stops a reply only
    # it runs only on cores nothing else wants (it sets that itself, once started)
    assert poll_until(lambda: os.sched_getscheduler(child.pid) == os.SCHED_IDLE)
    assert reaped_while_idle(child.pid)              # no zombie while the engine takes no step
    engine.compiled.wait()
    step = StepKey(batch=2, context=512)
    chunk = StepKey(chunks=(ChunkKey(32, 512, True),))
    assert run(engine) == want         # the prompts' chunks compile now, the decode step's key being ready
    engine.compiled.wait()
    assert engine.compiled.built[step][0] == engine.compiled.built[chunk][0] == "compiled apart"
    assert dict(dynamo_counters["stats"]) == graphs           # this process traced nothing
    steps = engine.compiled.eager_steps
    assert run(engine) == want
    assert engine.compiled.eager_steps == steps and engine.compiled.recompiles == 0
    saved = {engine.compiled._path(k).name for k in (step, chunk)}
    assert {p.name for p in compiled.steps_dir().iterdir()} == saved      # no part left

    # a later launch finds them saved: it loads each on a thread of its own once the engine idles (a load holds
    # the GIL for stretches: never during a reply), and the next step swaps it in
    later = load_engine(settings_for(path, drafts=0, max_batch=2, max_seq_len=512), "serve")
    assert run(later) == want and later.compiled.eager_steps > 0
    assert not later.compiled.ready and later.compiled.apart is None       # nothing loaded during steps
    assert poll_until(lambda: not later.compiled._to_load)                 # the decode step's, loaded while idle
    assert run(later) == want     # it swaps in; the chunk key (two uses a run) is scheduled at its fourth
    assert list(later.compiled.ready) == [step]
    assert poll_until(lambda: not later.compiled._to_load)
    steps = later.compiled.eager_steps
    assert run(later) == want and later.compiled.eager_steps == steps
    assert later.compiled.built[step][0] == later.compiled.built[chunk][0] == "loaded"
    later.close()

    # a compiling process that fails (here: the model gone before it loads) says so in one line; its step
    # shape stays eager, and no request fails for it
    failing = load_engine(settings_for(path, drafts=0, max_batch=1, max_seq_len=512), "serve")
    shutil.rmtree(path)
    assert run(failing) == want
    with pytest.raises(RuntimeError, match="compiling process failed"):
        failing.compiled.wait()
    assert run(failing) == want and list(failing.compiled.failed) == [step._replace(batch=1)]
    assert not failing.compiled.busy
    assert capfd.readouterr().err.strip().endswith("; that step shape runs eager")


def test_auto_drafting_measures_the_lengths_it_runs_while_steps_compile(monkeypatch, tmp_path):
    """While the background compiles, steps run eager with compile-off's shapes, and DSpark's auto measures each
    length's cost from them, at the batch it plans by: it doesn't stay on one length until a compile ends."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = load_engine(resolve(flags={"compile": "on", "drafts": "auto", "max_batch": 3, "max_seq_len": 512},
                                 env={})[0], "chat")
    try:
        assert engine.compiled is not None and engine.compiled.background
        prompt = engine.tok.encode("Once upon a time")
        engine.generate([prompt] * 3, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert not engine.compiled.ready
        assert {n for _, n in engine.lengths.cost} == set(range(engine.draft_depth + 1))
        assert {b for b, _ in engine.lengths.cost} == {3}      # not the bucket (4) a compiled step pads to
    finally:
        engine.close()


@COMPILER
def test_auto_compiles_where_a_compile_pays_off():
    """On the CPU: the verbs that run long with a small model, compiled beside the run; a one-shot generate, a
    short batch job, a large model or a --tp run (whose ranks compile in the foreground) runs eager."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for verb in LONG_RUNNING:
        on, say = choose_compile("auto", cpu, verb, small_model=True, beside=True)
        assert on and say.startswith(f"compile = auto: on ({verb}, small model on the CPU): each step shape "
                                     "compiles in a process of its own on idle cores only (")
        assert re.search(r"\(\d+\.\d of \d+ idle now\), at most 8 a run, and swaps in (while the engine idles|as it "
                         r"is ready); steps run eager meanwhile", say), say
    for verb, small, beside in (("generate", True, True), ("bench", True, False), ("chat", False, True),
                                ("chat", True, False)):
        assert choose_compile("auto", cpu, verb, small, beside) == (False, None)
    # a batch job: on once it is long enough to gain from a compile (requests x max_tokens)
    assert not choose_compile("auto", cpu, "batch", True, True, job_tokens=BATCH_COMPILE_TOKENS - 1)[0]
    assert choose_compile("auto", cpu, "batch", True, True, job_tokens=BATCH_COMPILE_TOKENS)[0]
    assert choose_compile("on", cpu, "batch", True, True, job_tokens=1) == (True, None)
    assert choose_compile("auto", cuda, "generate", small_model=False, beside=False)[0]
    assert choose_compile("on", cpu, "generate", small_model=False, beside=False) == (True, None)
    assert choose_compile("off", cpu, "chat", small_model=True, beside=True) == (False, None)


def test_saved_steps_unused_for_a_while_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    steps = compiled.steps_dir()
    steps.mkdir(parents=True)
    old_step, old_part, recent = steps / "a.bin", steps / "b.bin.7.part", steps / "c.bin"
    for path in (old_step, old_part, recent):
        path.write_bytes(b"step")
    stale = time.time() - (compiled.STEP_TTL_DAYS + 1) * 86400
    for path in (old_step, old_part):
        os.utime(path, (stale, stale))
    assert sorted(compiled.prune_steps()) == [old_step, old_part]
    assert [p.name for p in steps.iterdir()] == ["c.bin"]


def test_compile_without_a_cpp_compiler_says_so_and_runs_eager(tiny_model_dir):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable), "DSV4_COMPILE": "on"}
    env.pop("CXX", None)
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "generate", "--model", str(tiny_model_dir), "-p", "hi",
                        "-n", "4", "--raw"], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == ["compile: no C++ compiler found (install g++ or set CXX); running eager"]


def processes_with(env_entry: str) -> list[int]:
    """Live processes (of this user) whose environment holds `env_entry` ("NAME=value")."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if env_entry.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


@COMPILER
def test_a_run_that_ends_while_its_step_compiles_exits_cleanly(tiny_model_dir, tmp_path):
    """generate compiles in the background: its reply comes from eager steps and the process ends with its
    own exit code while the compile still runs, and the compiling process ends with it."""
    args = [sys.executable, "-m", "dsv4cli", "generate", "--model", str(tiny_model_dir), "-p", "hi", "-n", "6",
            "--raw", "--temperature", "0"]
    eager = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    env = {**os.environ, "DSV4_COMPILE": "on", "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert (r.returncode, r.stdout) == (0, eager.stdout), r.stderr
    assert not list((tmp_path / "dsv4cli" / "steps").glob("*.bin"))      # it ended before the step was saved
    if Path("/proc/self/environ").exists():
        deadline = time.monotonic() + 1       # SIGKILLed: gone at once
        while (left := processes_with(f"XDG_CACHE_HOME={tmp_path}")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, "a compiling process outlived its run"


@COMPILER
def test_a_run_killed_while_its_compile_is_stopped_leaves_no_process(tiny_model_dir, tmp_path):
    """The compiling process is stopped while the steps run (a compile beside them slows them here); a run
    SIGKILLed then can't close its stdin, yet the stopped process ends: its group, orphaned with stopped
    members, gets SIGHUP."""
    env = {**os.environ, "DSV4_COMPILE": "on", "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    run = subprocess.Popen([sys.executable, "-m", "dsv4cli", "generate", "--model", str(tiny_model_dir), "-p", "hi",
                            "-n", "100000", "--ignore-eos", "--raw"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        def stopped_child():
            return [pid for pid in processes_with(f"XDG_CACHE_HOME={tmp_path}") if pid != run.pid
                    and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"]
        assert poll_until(stopped_child, timeout=120), "no compiling process was stopped while the steps ran"
        children = processes_with(f"XDG_CACHE_HOME={tmp_path}")
        run.kill()
        run.wait()
        assert poll_until(lambda: not set(processes_with(f"XDG_CACHE_HOME={tmp_path}")) & set(children), timeout=5)
    finally:
        run.kill()


@COMPILER
def test_chat_compiles_by_default_on_the_cpu_and_ctrl_c_stops_only_the_reply(tiny_model_dir, tmp_path):
    """compile = auto in a terminal: chat says it compiles, streams eagerly meanwhile and says so; a Ctrl-C
    stops the reply, not the compiling process (a process group of its own), and quitting ends that process."""
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"), "TERM": "xterm-256color",
           "COLUMNS": "120", "LINES": "40"}
    for name in ("DSV4_COMPILE", "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(name, None)
    child = pexpect.spawn(sys.executable, ["-m", "dsv4cli", "chat", "--model", str(tiny_model_dir), "--temperature",
                                           "0", "--max-tokens", "2000", "--ignore-eos"], env=env, dimensions=(40, 120),
                          encoding="utf-8", timeout=60)
    child.expect(r"compile = auto: on \(chat, small model on the CPU")
    child.expect(">>> ")
    child.sendline("Tell me a long story")
    child.expect("eager, compiling")
    child.sendcontrol("c")
    child.expect("interrupted")
    child.expect(">>> ")
    child.sendline("Hello again")         # the same engine and step shape: a compile that died fails its steps
    child.expect("eager|compiled")     # a decode step ran (the bar shows it after one)
    child.sendcontrol("c")
    child.expect("interrupted")
    child.expect(">>> ")
    assert "error" not in child.before
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    deadline = time.monotonic() + 1       # SIGKILLed: gone at once
    while (left := processes_with(f"XDG_CACHE_HOME={tmp_path / 'cache'}")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "a compiling process outlived its run"
