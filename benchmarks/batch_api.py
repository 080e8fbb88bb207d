"""Online latency while an API batch runs: `dsv4 serve --batch-dir` with a 500-request batch in progress.

    python benchmarks/batch_api.py [--model PATH] [--rounds 3] [--online 30] [--batch 500] [--max-batch 8]
                                   [--batch-slots N] [--batch-tokens 64]

One server (eager: --compile off, so no step compiles mid-run), one client in this process (the `openai` SDK).
Each round measures the same online chat requests, streamed one after another with a random pause of 0-50 ms
between them (so they arrive at any point of a step), first on the idle server, then while a batch of
--batch chat requests of --batch-tokens tokens (ignore_eos) is in progress; the batch is cancelled after that.
TTFT is the time from sending a request to its first chunk with text. Reported per round: the median TTFT idle
and under the batch and their ratio (target <= 2), the online requests' time per output token, and the batch's
own rate meanwhile (requests and tokens per second, from its request_counts); min / median over rounds.
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meta import stamp

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France?", "What is 7 plus 12?", "What colour is the sky?",
           "What is the opposite of big?", "What sound does a dog make?", "Hello!"]
BATCH_PROMPTS = ["Tell me a story.", "Can you tell me a short story?", "What is the capital of Spain?",
                 "What is 9 plus 4?"]


def start_server(args, store: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dsv4cli", "serve", "--port", "0", "--temperature", "0", "--compile", "off",
           "--max-batch", str(args.max_batch), "--batch-dir", str(store)]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--batch-slots", str(args.batch_slots)] if args.batch_slots else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    line = proc.stdout.readline()
    match = re.search(r"(http://\S+/v1)", line)
    if match is None:
        proc.kill()
        sys.exit(f"no URL from dsv4 serve: {line!r}")
    print(line.strip(), file=sys.stderr)
    return proc, match[1]


def online(client, n: int, rng: random.Random) -> list[dict]:
    """n streamed chat requests one after another: TTFT and time per output token of each."""
    runs = []
    for i in range(n):
        time.sleep(rng.uniform(0, 0.05))
        t0 = time.perf_counter()
        first, tokens = None, 0
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPTS[i % 6]}],
                                                max_tokens=8, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter()
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        runs.append({"ttft_s": first - t0, "tpot_s": (end - first) / max(tokens - 1, 1)})
    return runs


def batch_file(path: Path, n: int, max_tokens: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": BATCH_PROMPTS[i % 4]}],
                                         "max_tokens": max_tokens, "ignore_eos": True}}) + "\n")
    return path


def summary(runs: list[dict]) -> dict:
    return {"ttft_median_s": statistics.median(r["ttft_s"] for r in runs),
            "tpot_median_s": statistics.median(r["tpot_s"] for r in runs), "runs": runs}


def round_(client, args, file_id: str, rng: random.Random) -> dict:
    idle = summary(online(client, args.online, rng))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 1:      # its requests hold their slots
        time.sleep(0.05)
    t0, done0 = time.perf_counter(), client.batches.retrieve(batch.id).request_counts.completed
    loaded = summary(online(client, args.online, rng))
    after = client.batches.retrieve(batch.id)
    dt, done = time.perf_counter() - t0, after.request_counts.completed - done0
    client.batches.cancel(batch.id)
    while client.batches.retrieve(batch.id).status != "cancelled":
        time.sleep(0.05)
    ratio = loaded["ttft_median_s"] / idle["ttft_median_s"]
    result = {"idle": idle, "under_batch": loaded, "ttft_ratio": ratio, "batch_status_at_end": after.status,
              "batch_requests_per_s": done / dt, "batch_tokens_per_s": done * args.batch_tokens / dt}
    print(f"TTFT median idle {idle['ttft_median_s'] * 1000:.1f} ms, under the batch "
          f"{loaded['ttft_median_s'] * 1000:.1f} ms: {ratio:.2f}x; TPOT {idle['tpot_median_s'] * 1000:.1f} -> "
          f"{loaded['tpot_median_s'] * 1000:.1f} ms; batch {result['batch_requests_per_s']:.2f} req/s, "
          f"{result['batch_tokens_per_s']:.0f} tok/s ({after.status})", file=sys.stderr)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--online", type=int, default=30, help="online requests per phase")
    p.add_argument("--batch", type=int, default=500, help="requests in the API batch")
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--batch-slots", type=int, help="the server's --batch-slots (unset: its default)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/batch-api-cpu-1thread.json")
    args = p.parse_args()
    import openai

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(args, Path(tmp) / "store")
        try:
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
            online(client, 3, rng)      # warm-up: the client's types, the server's first steps
            file_id = client.files.create(file=batch_file(Path(tmp) / "batch.jsonl", args.batch, args.batch_tokens),
                                          purpose="batch").id
            rounds = [round_(client, args, file_id, rng) for _ in range(args.rounds)]
        finally:
            proc.terminate()
            proc.wait()
    ratios = [r["ttft_ratio"] for r in rounds]
    result = {"meta": stamp(vars(args)), "ttft_ratio_min": min(ratios), "ttft_ratio_median": statistics.median(ratios),
              "rounds": rounds}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"TTFT under a {args.batch}-request batch / idle: min {min(ratios):.2f}x, median "
          f"{statistics.median(ratios):.2f}x (target <= 2) -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
