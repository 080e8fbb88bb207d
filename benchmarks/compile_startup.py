"""Launch to the first streamed tokens with compile off / on (cold cache, warm cache), and when the compiled
step takes over.

Two measures per case, each in a fresh process:
- `dsv4 chat` piped, one message on stdin: every chunk of the reply timestamped as it streams (first chunk,
  next chunk, the longest gap between chunks);
- the engine as chat builds it (compile in the background), one long greedy reply: time to the first token,
  to the compiled step being ready (compiled, or loaded from the saved step), and tokens/s before and after.
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


def takeover(max_tokens: int) -> dict:
    """In this process: the chat engine, one long reply, the step in which the compiled step took over."""
    t0 = time.perf_counter()
    import dataclasses

    from dsv4cli.config import resolve
    from dsv4cli.engine import SamplingParams
    from dsv4cli.loading import load_engine

    engine = load_engine(dataclasses.replace(resolve()[0], max_batch=1, mode="chat"))
    loaded = time.perf_counter() - t0
    prompt = engine.tok.encode("Once upon a time, a little fox named Ben lived by the river.")
    seq = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    ready_at = ready_tokens = None
    while engine.has_work():
        engine.step()
        if ready_at is None and engine.compiled is not None and engine.compiled.ready:
            ready_at, ready_tokens = time.perf_counter(), len(seq.output_ids)
    m = seq.metrics
    out = {"load_s": round(loaded, 2), "first_token_s": round(m.t_first - t0, 2), "tokens": len(seq.output_ids)}
    if ready_at is None:
        return {**out, "tokens_per_s": round(m.tokens_per_s, 1)}
    how, seconds = next(iter(engine.compiled.built.values()))
    before = (ready_tokens - 1) / max(ready_at - m.t_first, 1e-9)
    after = (len(seq.output_ids) - ready_tokens) / max(m.t_last - ready_at, 1e-9)
    return {**out, "step": how, "step_build_s": round(seconds, 2), "compiled_ready_s": round(ready_at - t0, 2),
            "tokens_before_ready": ready_tokens, "eager_tokens_per_s": round(before, 1),
            "compiled_tokens_per_s": round(after, 1)}


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
    ap.add_argument("--long-tokens", type=int, default=3000, help="reply length of the takeover run")
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
                r["long_reply"] = run_takeover(mode, cache, a.long_tokens)
            results.append(r)
            print(json.dumps(results[-1]), file=sys.stderr)
    report = {"benchmark": "compile_startup", "message": a.message, "max_tokens": a.max_tokens,
              "long_tokens": a.long_tokens, "results": results}
    text = json.dumps(report, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
