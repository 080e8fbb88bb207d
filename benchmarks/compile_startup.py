"""Launch to the first streamed tokens with compile off / on (cold cache, warm cache), and when the compiled
step takes over.

Two measures per case, each in a fresh process:
- `dsv4 chat` piped, one message on stdin: every chunk of the reply timestamped as it streams (first chunk,
  next chunk, the longest gap between chunks);
- the engine as chat builds it (compile in the background), greedy replies one after another until one
  runs compiled throughout (with mtp auto a reply uses a step shape per draft length, compiled one after
  another): time to the first token, to the first compiled step being ready (compiled, or loaded from the
  saved step) and to the reply that ran compiled throughout, each reply's tokens/s and eager steps, the
  tokens/s of the replies before the first step was ready (eager) and of the last (compiled).
The first token comes out of prefill (eager in every mode); decode steps run eagerly until the step is ready.
Results: JSON on stdout, or --out.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meta import stamp


def run_chat(compile_mode: str, cache: str, message: str, max_tokens: int) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": cache, "DSV4_COMPILE": compile_mode}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dsv4cli", "chat", "--max-tokens", str(max_tokens),
                             "--temperature", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    proc.stdin.write((message + "\n").encode())
    proc.stdin.close()
    chunks = []
    while True:
        data = os.read(proc.stdout.fileno(), 4096)
        if not data:
            break
        if data.strip():
            chunks.append(time.perf_counter() - t0)
    proc.wait()
    gaps = [b - a for a, b in zip(chunks, chunks[1:])]
    return {"first_token_s": round(chunks[0], 2) if chunks else None,
            "second_chunk_s": round(chunks[1], 2) if len(chunks) > 1 else None,
            "max_gap_s": round(max(gaps), 2) if gaps else None,
            "exit_s": round(time.perf_counter() - t0, 2), "chunks": len(chunks), "returncode": proc.returncode}


def takeover(reply_tokens: int, max_replies: int = 200) -> dict:
    """In this process: the chat engine, replies one after another until one runs compiled throughout (with
    mtp auto a reply uses a step shape per draft length, each compiled in turn)."""
    t0 = time.perf_counter()
    import dataclasses

    from dsv4cli.config import resolve
    from dsv4cli.engine import SamplingParams
    from dsv4cli.loading import load_engine

    engine = load_engine(dataclasses.replace(resolve()[0], max_batch=1, mode="chat"), "chat")
    loaded = time.perf_counter() - t0
    prompt = engine.tok.encode("Once upon a time, a little fox named Ben lived by the river.")
    params = SamplingParams(temperature=0, max_tokens=reply_tokens, ignore_eos=True)
    compiled = engine.compiled
    first = ready_at = None
    eager_tokens, eager_s = 0, 0.0          # of the replies that ran eagerly throughout
    replies = []                            # per reply: (tokens/s, its steps that ran eager)
    while len(replies) < max_replies:
        eager_before, started = compiled.eager_steps, time.perf_counter()
        seq = engine.submit(prompt, params)
        while engine.has_work():
            engine.step()
            if ready_at is None and any(key.batch for key in compiled.ready):
                ready_at = time.perf_counter()
        m = seq.metrics
        first = m.t_first - t0 if first is None else first
        replies.append((round(m.tokens_per_s, 1), compiled.eager_steps - eager_before))
        if replies[-1][1] == 0:             # no step of this reply ran eager: every shape it used is ready
            break
        if ready_at is None:
            eager_tokens, eager_s = eager_tokens + m.output_tokens - 1, eager_s + m.t_last - m.t_first
    decode = [key for key in compiled.ready if key.batch]
    how, seconds = compiled.built[decode[0]]
    return {"load_s": round(loaded, 2), "first_token_s": round(first, 2), "step": how,
            "step_build_s": round(seconds, 2), "first_compiled_ready_s": round(ready_at - t0, 2),
            "all_compiled_s": round(started - t0, 2) if replies[-1][1] == 0 else None,
            "decode_shapes": len(decode), "replies": replies,
            "eager_tokens_per_s": round(eager_tokens / eager_s, 1) if eager_s else None,
            "compiled_tokens_per_s": replies[-1][0] if replies[-1][1] == 0 else None}


def run_takeover(compile_mode: str, cache: str, max_tokens: int) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": cache, "DSV4_COMPILE": compile_mode}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    r = subprocess.run([sys.executable, __file__, "--takeover", str(max_tokens)], capture_output=True, text=True,
                       env=env, check=True)
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--message", default="Tell me a story.")
    ap.add_argument("--max-tokens", type=int, default=16, help="chat reply length")
    ap.add_argument("--reply-tokens", type=int, default=400, help="reply length in the takeover runs")
    ap.add_argument("--takeover", type=int, default=None, help=argparse.SUPPRESS)   # the inner process
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.takeover is not None:
        print(json.dumps(takeover(a.takeover)))
        return
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for label, mode in (("off", "off"), ("on, cold cache", "on"), ("on, warm cache", "on")):
            r = {"case": label, "compile": mode, "chat": run_chat(mode, cache, a.message, a.max_tokens)}
            if mode == "on":    # the takeover run after chat's: its cache is as the case says
                r["takeover"] = run_takeover(mode, cache, a.reply_tokens)
            results.append(r)
            print(json.dumps(results[-1]), file=sys.stderr)
    report = {"meta": stamp(vars(a)), "benchmark": "compile_startup", "message": a.message, "max_tokens": a.max_tokens,
              "reply_tokens": a.reply_tokens, "results": results}
    text = json.dumps(report, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
