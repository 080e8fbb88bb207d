"""The prefix cache's targets on the bundled model, through the CLI, in one run.

    python benchmarks/prefix_cache.py [--repeats 2] [--out results/prefix-cache-cpu-1thread.json]

- batch: `dsv4 batch`, 64 requests after one ~2,000-token system prompt with short distinct questions, greedy,
  16 tokens each, with the store off (`--prefix-cache-bytes 0`, today's behaviour) and on (the default),
  alternated. Reported: wall time, prefilled tokens (prompt tokens minus usage's cached_tokens), whether the
  answers are identical, and each run's peak RSS (`wait4`). Targets: prefilled <= 1/8, wall >= 3x faster.
- serve: `dsv4 serve` (store on, and a second server with it off), a ~3,000-token prompt sent, then sent again;
  each time a new prompt (its first token differs). TTFT is the engine's (`dsv4_stats.ttft_s`, from arrival
  to the first token). Target: repeated <= 0.2x first. The store-off server's first TTFT shows what cutting
  prefill chunks at snapshot boundaries costs a cold prompt.
- chat: a ~3,000-token conversation (a transcript file) in `dsv4 chat` on a pseudo-terminal: answered once and
  saved with its state (`/save`); then `dsv4 chat --resume` answers one more message with the state beside the
  transcript and without it (a fresh prefill of the same conversation), alternated. TTFT from the reply's
  summary line. Target: resumed <= 0.2x fresh.

Every verb runs with --compile off and one thread: a compile beside the run would share the cores.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from meta import stamp

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COMMON = ["--compile", "off", "--temperature", "0"]
QUESTIONS = ["What is the capital of {}?", "What is {} plus 7?", "What colour is the {}?", "Tell me about a {}."]
WORDS = ["France", "Spain", "Italy", "Japan", "Peru", "Chile", "Egypt", "Kenya"]


def long_text(tokens: int, tok, lead: str = "") -> str:
    """A system prompt of about `tokens` tokens: library rules, repeated."""
    rule = "The library opens at nine and closes at five; answer briefly and kindly. "
    text = lead
    while len(tok.encode(text)) < tokens:
        text += rule
    return text


def run_measured(cmd: list[str]) -> tuple[int, str, str, float, int]:
    """A command's exit code, stdout, stderr, wall seconds and peak RSS in bytes (its own, from wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=ENV)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), wall, usage.ru_maxrss * 1024


def batch(tok, tmp: Path, repeats: int) -> dict:
    system = long_text(2000, tok)
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": QUESTIONS[i % 4].format(WORDS[i % 8]) + f" ({i})"}],
                       "max_completion_tokens": 16}} for i in range(64)]
    src = tmp / "batch.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    runs = []
    for r in range(repeats):
        for cache in ("0", "default"):
            out = tmp / f"out-{r}-{cache}.jsonl"
            flags = ["--prefix-cache-bytes", "0"] if cache == "0" else []
            code, _, stderr, wall, rss = run_measured([sys.executable, "-m", "dsv4cli", "batch", str(src), "-o",
                                                       str(out), *COMMON, *flags])
            assert code == 0, stderr
            records = [json.loads(x) for x in out.read_text().splitlines()]
            bodies = {rec["custom_id"]: rec["response"]["body"] for rec in records}
            prompt = sum(b["usage"]["prompt_tokens"] for b in bodies.values())
            cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies.values())
            run = {"store": cache != "0", "wall_s": round(wall, 2), "prompt_tokens": prompt, "cached_tokens": cached,
                   "prefilled_tokens": prompt - cached, "peak_rss_bytes": rss,
                   "summary": stderr.strip().splitlines()[-1],
                   "answers": {k: b["choices"][0]["message"]["content"] for k, b in sorted(bodies.items())}}
            runs.append(run)
            print(f"batch store {'on ' if run['store'] else 'off'}: {wall:.1f} s, prefilled {prompt - cached} of "
                  f"{prompt}, peak RSS {run['peak_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    off, on = [r for r in runs if not r["store"]], [r for r in runs if r["store"]]
    identical = all(r["answers"] == off[0]["answers"] for r in runs)
    for r in runs:
        del r["answers"]
    wall_off, wall_on = min(r["wall_s"] for r in off), min(r["wall_s"] for r in on)
    rss_off, rss_on = max(r["peak_rss_bytes"] for r in off), max(r["peak_rss_bytes"] for r in on)
    return {"runs": runs, "system_prompt_tokens": len(tok.encode(system)), "identical_answers": identical,
            "prefilled_ratio": round(on[0]["prefilled_tokens"] / off[0]["prefilled_tokens"], 4),
            "speedup": round(wall_off / wall_on, 2), "rss_on_over_off": round(rss_on / rss_off, 4),
            "rss_within_budget_plus_5pct": rss_on <= 1.05 * rss_off + (1 << 30)}


class Server:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "dsv4cli", "serve", "--port", "0", *COMMON, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
        self.url = re.search(r"(http://\S+)/v1", self.proc.stdout.readline())[1]

    def ttft(self, system: str, question: str) -> tuple[float, int]:
        body = {"model": "x", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        req = urllib.request.Request(self.url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            reply = json.loads(r.read())
        return reply["dsv4_stats"]["ttft_s"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def serve(tok, repeats: int) -> dict:
    on, off = Server(), Server("--prefix-cache-bytes", "0")
    rows = []
    try:
        for r in range(repeats + 1):           # the first round warms both servers up (not counted)
            system = long_text(3000, tok, lead=f"Library {r}. ")
            first, _ = on.ttft(system, "What is the capital of France?")
            again, cached = on.ttft(system, "What is the capital of France?")
            cold_off, _ = off.ttft(system, "What is the capital of France?")
            if r:
                rows.append({"prompt_tokens": len(tok.encode(system)), "first_ttft_s": first, "repeat_ttft_s": again,
                             "repeat_cached_tokens": cached, "store_off_first_ttft_s": cold_off})
                print(f"serve: first {first:.2f} s, repeated {again:.3f} s ({cached} cached), store off "
                      f"{cold_off:.2f} s", file=sys.stderr)
    finally:
        on.stop()
        off.stop()
    ratios = [row["repeat_ttft_s"] / row["first_ttft_s"] for row in rows]
    cut = [row["first_ttft_s"] / row["store_off_first_ttft_s"] for row in rows]
    return {"rows": rows, "repeat_over_first": round(statistics.median(ratios), 4),
            "first_with_store_over_without": round(statistics.median(cut), 3)}


def chat_ttft(transcript: Path, message: str, save: Path | None = None) -> tuple[float, int, int]:
    """`dsv4 chat --resume transcript` on a pseudo-terminal, one message: its TTFT (s), prompt and reused tokens."""
    import pexpect
    child = pexpect.spawn(sys.executable, ["-m", "dsv4cli", "chat", *COMMON, "--max-tokens", "8", "--resume",
                                           str(transcript)], env={**ENV, "COLUMNS": "200"}, dimensions=(40, 200),
                          encoding="utf-8", timeout=600)
    child.expect(">>> ")
    child.sendline(message)
    child.expect(r"prompt (\d+)(?: \((\d+) reused\))? · TTFT ([\d.]+) ms")
    prompt, reused, ms = int(child.match[1]), int(child.match[2] or 0), float(child.match[3])
    child.expect(">>> ")
    if save is not None:
        child.sendline(f"/save {save}")
        child.expect("saved the decode state")
        child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    return ms / 1000, prompt, reused


def chat(tok, tmp: Path, repeats: int) -> dict:
    """A transcript of ~3,000 tokens answered and saved with its state, then resumed with and without it."""
    from dsv4cli.encoding import encode_messages
    messages = []
    while not messages or len(tok.encode(encode_messages(messages))) < 2950:
        messages += [{"role": "user", "content": long_text(280, tok, lead=f"Note {len(messages)}: ")},
                     {"role": "assistant", "content": "Noted."}]
    start = tmp / "start.json"
    start.write_text(json.dumps({"messages": messages, "settings": {}}))
    saved = tmp / "chat.json"
    chat_ttft(start, "What is the capital of France?", save=saved)
    state = saved.with_name(saved.name + ".safetensors")
    hidden = tmp / "state.away"
    rows = []
    for r in range(repeats):
        resumed = chat_ttft(saved, QUESTIONS[1].format(r + 2))
        shutil.move(state, hidden)
        fresh = chat_ttft(saved, QUESTIONS[1].format(r + 2))
        shutil.move(hidden, state)
        rows.append({"prompt_tokens": resumed[1], "resumed_ttft_s": resumed[0], "resumed_reused": resumed[2],
                     "fresh_ttft_s": fresh[0], "fresh_reused": fresh[2]})
        print(f"chat: prompt {resumed[1]}: resumed {resumed[0] * 1000:.0f} ms ({resumed[2]} reused), fresh "
              f"{fresh[0] * 1000:.0f} ms", file=sys.stderr)
    return {"rows": rows, "resumed_over_fresh": round(statistics.median(r["resumed_ttft_s"] / r["fresh_ttft_s"]
                                                                        for r in rows), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parts", default="batch,serve,chat")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    result = {"meta": {**stamp(vars(args)), "model": "dsv4-tiny (bundled)", "device": "cpu", "threads": 1}}
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts.split(","):
            extra = [] if part == "serve" else [Path(tmp)]
            result[part] = {"batch": batch, "serve": serve, "chat": chat}[part](tok, *extra, args.repeats)
            if args.out:          # after each part: a later part's failure keeps what ran
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
