"""The agent APIs against chat completions on one `dsv4 serve`: 16 concurrent streams of each, alternated.

    python benchmarks/agent_apis.py [--model PATH] [--requests 16] [--max-batch 16] [--max-tokens 128] [--repeats 3]

Each run sends the same requests (greedy, ignore_eos: every reply has max_tokens tokens) as concurrent streams,
one thread each, through the real SDKs: `openai` chat.completions, `anthropic` messages, `openai` responses.
Reported per API: aggregate output tokens/s (all output tokens over the wall time from the first request sent
to the last stream ended), TTFT p50 / p99 (to the first text delta), the ratio to chat completions, and whether
the greedy texts equal chat's. The APIs are alternated --repeats times after one unmeasured warm-up round (the
SDKs build their types on first use); the best run of each counts (the machine is shared), all are kept.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from meta import stamp

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me a story.", "Can you tell me a short story?", "Tell me a story about a fox.",
           "Please tell me a story.", "What is the capital of France?", "What is 7 plus 12?",
           "What colour is the sky?", "What is the opposite of big?"]
APIS = ("chat", "messages", "responses")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def stream(api: str, url: str, prompt: str, max_tokens: int):
    """Yields the reply's text deltas, then its output token count (an int)."""
    import anthropic
    import openai

    if api == "messages":
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=600)
        for e in client.messages.create(model="x", max_tokens=max_tokens, stream=True,    # (no temperature argument)
                                        extra_body={"temperature": 0, "ignore_eos": True},
                                        messages=[{"role": "user", "content": prompt}]):
            if e.type == "content_block_delta" and e.delta.type == "text_delta":
                yield e.delta.text
            elif e.type == "message_delta":
                yield e.usage.output_tokens
        return
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    if api == "responses":
        for e in client.responses.create(model="x", input=prompt, max_output_tokens=max_tokens, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}):
            if e.type == "response.output_text.delta":
                yield e.delta
            elif e.type in ("response.completed", "response.incomplete"):
                yield e.response.usage.output_tokens
        return
    for chunk in client.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            yield chunk.usage.completion_tokens
        elif chunk.choices and chunk.choices[0].delta.content:
            yield chunk.choices[0].delta.content


def run(api: str, url: str, n: int, max_tokens: int) -> dict:
    """n concurrent streams of one API, released together."""
    results: list[dict] = [{} for _ in range(n)]
    go = threading.Barrier(n)

    def one(i: int) -> None:
        go.wait()
        t0, first, text, tokens = time.perf_counter(), None, [], 0
        for piece in stream(api, url, PROMPTS[i % len(PROMPTS)], max_tokens):
            if isinstance(piece, int):
                tokens = piece
            else:
                first = first or time.perf_counter()
                text.append(piece)
        results[i] = {"start": t0, "first": first, "end": time.perf_counter(), "tokens": tokens,
                      "text": "".join(text)}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["first"] - r["start"] for r in results]
    return {"output_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
            "ttft_mean_s": round(statistics.mean(ttft), 4), "texts": [r["text"] for r in results]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three APIs, alternated; the best counts")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agent-apis-cpu.json"))
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}      # the engine on 1 thread (the bundled model's default)
    cmd = [sys.executable, "-m", "dsv4cli", "serve", "--port", "0", "--max-batch", str(args.max_batch),
           *(["--model", args.model] if args.model else [])]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        url = re.search(r"(http://\S+)/v1", server.stdout.readline())[1]
        for api in APIS:                    # warm-up: the SDKs' types, the server's first requests
            run(api, url, args.requests, 8)
        runs, same = [], True
        for _ in range(args.repeats):
            round_ = {api: run(api, url, args.requests, args.max_tokens) for api in APIS}
            texts = {api: r.pop("texts") for api, r in round_.items()}
            same &= texts["messages"] == texts["chat"] == texts["responses"]
            runs.append(round_)
    finally:
        server.terminate()
        server.wait()
    best = {api: max((r[api] for r in runs), key=lambda r: r["tokens_per_s"]) for api in APIS}
    result = {"meta": stamp(vars(args)), "model": args.model or "dsv4-tiny (bundled)", "requests": args.requests,
              "max_batch": args.max_batch, "max_tokens": args.max_tokens, "best": best,
              "over_chat": {api: round(best[api]["tokens_per_s"] / best["chat"]["tokens_per_s"], 3)
                            for api in APIS[1:]},
              "greedy_texts_identical": same, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
