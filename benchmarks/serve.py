"""`dsv4 serve` against `dsv4 batch` on the same 16 requests, with the same --max-batch, in one run.

    python benchmarks/serve.py [--model PATH] [--requests 16] [--max-batch 16] [--max-tokens 128] [--repeats 3]

The server gets 16 concurrent streaming clients from a separate process (this script run with --client: one
thread per request, the `openai` client, stream_options.include_usage). Reported: aggregate output tokens/s
(all completion tokens over the wall time from the first request sent to the last reply ended), the ratio
serve / batch (target >= 0.8), and the clients' TTFT p50 / p99 (to the first chunk with text). Batch's
rate is its own summary line's (tokens over the time after the model loaded); the server's clock starts
after it printed its URL, so neither counts loading. Greedy, ignore_eos: every reply has max_tokens tokens.
Each is run --repeats times, alternated; the best run of each counts (the machine is shared), all are kept.
"""
import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from meta import stamp

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me a story.", "Can you tell me a short story?", "Tell me a story about a fox.",
           "Please tell me a story.", "What is the capital of France?", "What is 7 plus 12?",
           "What colour is the sky?", "What is the opposite of big?"]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def client(url: str, n: int, max_tokens: int) -> dict:
    """The client process: n concurrent streams; per request its start, first text and end times."""
    import openai
    from openai.types.chat import ChatCompletionChunk

    api = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    # The client's first request and first chunk build its request and response types (seconds on a busy
    # core, in every thread at once): build them first, with a body the server refuses before the engine.
    with contextlib.suppress(openai.BadRequestError):
        api.chat.completions.create(model="x", messages=messages(0), stream=True, extra_body={"warm_up": 1})
    ChatCompletionChunk.model_validate({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "x",
                                        "choices": [{"index": 0, "delta": {"content": "x"}}]})
    results: list[dict] = [{} for _ in range(n)]
    go = threading.Barrier(n)

    def one(i: int) -> None:
        go.wait()
        t0 = time.perf_counter()
        first, text, tokens = None, [], 0
        for chunk in api.chat.completions.create(model="x", messages=messages(i), max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
        results[i] = {"start": t0, "first": first, "end": time.perf_counter(), "tokens": tokens,
                      "text": "".join(text)}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": results}


def run_serve(args, env: dict) -> dict:
    cmd = [sys.executable, "-m", "dsv4cli", "serve", "--port", "0", "--max-batch", str(args.max_batch),
           *(["--model", args.model] if args.model else [])]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        url = re.search(r"(http://\S+/v1)", server.stdout.readline())[1]
        out = subprocess.run([sys.executable, __file__, "--client", url, "--requests", str(args.requests),
                              "--max-tokens", str(args.max_tokens)], capture_output=True, text=True, env=env,
                             check=True)
    finally:
        server.terminate()
        server.wait()
    reqs = json.loads(out.stdout)["requests"]
    wall = max(r["end"] for r in reqs) - min(r["start"] for r in reqs)
    tokens = sum(r["tokens"] for r in reqs)
    ttft = [r["first"] - r["start"] for r in reqs]
    return {"output_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
            "ttft_mean_s": round(statistics.mean(ttft), 4), "texts": [r["text"] for r in reqs]}


def run_batch(args, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions",
                                           "body": {"messages": messages(i), "max_tokens": args.max_tokens,
                                                    "temperature": 0, "ignore_eos": True}}) + "\n"
                               for i in range(args.requests)))
        cmd = [sys.executable, "-m", "dsv4cli", "batch", str(src), "-o", str(out), "--max-batch", str(args.max_batch),
               *(["--model", args.model] if args.model else [])]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        records = [json.loads(line) for line in out.read_text().splitlines()]
    tokens, seconds = re.search(r"(\d+) tokens in ([\d.]+) s", run.stderr).groups()
    ttft = [r["response"]["body"]["dsv4_stats"]["ttft_s"] for r in records]
    texts = {int(r["custom_id"]): r["response"]["body"]["choices"][0]["message"]["content"] for r in records}
    tokens, seconds = int(tokens), float(seconds)
    return {"output_tokens": tokens, "wall_s": seconds, "tokens_per_s": round(tokens / seconds, 2),
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
            "texts": [texts[i] for i in range(args.requests)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs of each, alternated; the best counts")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve-cpu.json"))
    p.add_argument("--client", help=argparse.SUPPRESS)      # the client process, started by this script
    args = p.parse_args()
    if args.client:
        print(json.dumps(client(args.client, args.requests, args.max_tokens)))
        return
    # the engines run on 1 thread (the bundled model's default); the client is its own process
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSV4_TEMPERATURE": "0"}
    runs, same = [], True
    for _ in range(args.repeats):       # alternated, so load from other work hits both alike
        batch, serve = run_batch(args, env), run_serve(args, env)
        same &= batch.pop("texts") == serve.pop("texts")
        runs.append({"batch": batch, "serve": serve,
                     "serve_over_batch": round(serve["tokens_per_s"] / batch["tokens_per_s"], 3)})
    best = {kind: max((run[kind] for run in runs), key=lambda r: r["tokens_per_s"]) for kind in ("batch", "serve")}
    result = {"meta": stamp(vars(args)),
              "model": args.model or "dsv4-tiny (bundled)", "requests": args.requests, "max_batch": args.max_batch,
              "max_tokens": args.max_tokens, "cpu_cores": len(os.sched_getaffinity(0)), "best": best,
              "serve_over_batch": round(best["serve"]["tokens_per_s"] / best["batch"]["tokens_per_s"], 3),
              "greedy_texts_identical": same, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
