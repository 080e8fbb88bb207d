"""Launch to the first streamed tokens of `dsv4 chat` (piped), compile off / on with a cold and a warm cache.

Each run starts `dsv4 chat` in a fresh process with one message on stdin and timestamps every chunk of the
reply as it streams. The first chunk comes out of prefill (eager in every mode); the next one out of the
first decode step, which compiles when compile is on (cold: an empty cache directory; warm: the same
directory again). Results: JSON on stdout, or --out.
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
    return {"compile": compile_mode, "first_token_s": round(chunks[0], 2) if chunks else None,
            "second_chunk_s": round(chunks[1], 2) if len(chunks) > 1 else None,
            "exit_s": round(time.perf_counter() - t0, 2), "chunks": len(chunks), "returncode": proc.returncode}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--message", default="Tell me a story.")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for label, mode in (("off", "off"), ("on, cold cache", "on"), ("on, warm cache", "on")):
            r = run_chat(mode, cache, a.message, a.max_tokens)
            results.append({"case": label, **r})
            print(json.dumps(results[-1]), file=sys.stderr)
    report = {"benchmark": "compile_startup", "message": a.message, "max_tokens": a.max_tokens, "results": results}
    text = json.dumps(report, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
