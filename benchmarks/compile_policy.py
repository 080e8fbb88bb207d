"""The default compile policy against `--compile off`: a long chat (and serve) session, minute by minute.

    python benchmarks/compile_policy.py [--minutes 20] [--serve-minutes 5] [--verbs chat,serve] [--busy-cores 1]
        [--out F]

Each case runs in a fresh process with a cold cache (the default compiles from nothing), one after another:
- chat: the engine `dsv4 chat` builds (one slot, the bundled model, DSpark auto, its sampling defaults),
  a conversation of turns: a user message, a reply of up to --reply-tokens, then --think seconds of a user
  reading and typing; the conversation starts over before it outgrows the context;
- serve: the engine `dsv4 serve` builds, --clients requests always in flight (it never idles).
Per minute of the session: decode tokens/s (the replies' tokens after the first, over their decode time),
the worst gap between one stream's consecutive tokens, the steps that ran compiled, and what the compile
machinery did (keys ready, compiling). With --busy-cores N, N other processes spin for the whole case.
The ratios default / off per minute are the figures the policy is judged by (>= 0.95).
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meta import stamp

USER_TURNS = ["Tell me a story about a fox.", "What happened next?", "Why did the fox do that?",
              "Tell me about the river.", "And the little bird?", "How does it end?"]


def session(verb: str, minutes: float, reply_tokens: int, think: float, clients: int) -> dict:
    """In this process: the engine `verb` builds with the default settings (compile as chosen), driven for
    `minutes`; per-minute figures."""
    from dsv4cli.config import resolve
    from dsv4cli.loading import load_engine, sampling_params

    s = resolve()[0]
    t0 = time.perf_counter()
    engine = load_engine(dataclasses.replace(s, max_batch=1 if verb == "chat" else max(clients, s.max_batch),
                                             mode=verb), verb)
    params = dataclasses.replace(sampling_params(s), max_tokens=reply_tokens, ignore_eos=True)
    minutes_log: dict[int, dict] = {}

    def minute(t: float) -> dict:
        return minutes_log.setdefault(int((t - t0) // 60), {"tokens": 0, "decode_s": 0.0, "worst_gap_ms": 0.0,
                                                              "steps": 0, "compiled_steps": 0})

    history: list[int] = []
    turn = 0
    live: dict[int, float | None] = {}          # id(seq) -> time of its latest token

    def submit():
        nonlocal history, turn
        if verb == "chat":
            message = engine.tok.encode(f"User: {USER_TURNS[turn % len(USER_TURNS)]}\nAssistant:")
            if len(history) + len(message) + reply_tokens + 8 >= engine.max_seq_len:
                history = []            # a new conversation
            ids = history + message
        else:
            ids = engine.tok.encode(f"Request {turn}: {USER_TURNS[turn % len(USER_TURNS)]}")
        turn += 1
        seq = engine.submit(ids, params)
        live[id(seq)] = None
        return seq, ids

    pending = [submit() for _ in range(1 if verb == "chat" else clients)]
    while time.perf_counter() - t0 < minutes * 60:
        events = engine.step()
        now = time.perf_counter()
        m = minute(now)
        m["steps"] += 1
        compiled = engine.compiled is not None and engine.compiled.last_compiled
        m["compiled_steps"] += compiled
        for ev in events:
            last = live.get(id(ev.seq))
            if last is not None:
                m["worst_gap_ms"] = max(m["worst_gap_ms"], round((now - last) * 1e3, 1))
            live[id(ev.seq)] = now
            if ev.finished:
                seq = ev.seq
                del live[id(seq)]
                done = minute(seq.metrics.t_last)
                done["tokens"] += seq.metrics.output_tokens - 1
                done["decode_s"] += seq.metrics.t_last - seq.metrics.t_first
                for i, (p, ids) in enumerate(pending):
                    if p is seq:
                        history = ids + seq.output_ids if verb == "chat" else history
                        pending.pop(i)
                        break
                if verb == "chat":
                    time.sleep(think)       # the user reads and types; the engine idles
                pending.append(submit())
        if engine.compiled is not None:
            c = engine.compiled
            m["ready"], m["status"] = len(c.ready), c.status
    engine.close()
    rows = []
    for i in sorted(minutes_log):
        m = minutes_log[i]
        rows.append({"minute": i + 1, "tokens_per_s": round(m["tokens"] / m["decode_s"], 1) if m["decode_s"] else None,
                     **{k: v for k, v in m.items() if k not in ("decode_s",)}})
    return {"verb": verb, "minutes": rows,
            "built": {str(k): v for k, v in engine.compiled.built.items()} if engine.compiled else None,
            "lengths": engine.lengths.report() if getattr(engine, "lengths", None) else None}


def run_case(verb: str, compile_mode: str, a, busy: int) -> dict:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "XDG_CACHE_HOME": cache, "DSV4_COMPILE": compile_mode}
            env.pop("TORCHINDUCTOR_CACHE_DIR", None)
            minutes = a.minutes if verb == "chat" else a.serve_minutes
            r = subprocess.run([sys.executable, __file__, "--inner", verb, "--minutes", str(minutes),
                                "--reply-tokens", str(a.reply_tokens), "--think", str(a.think),
                                "--clients", str(a.clients)], capture_output=True, text=True, env=env, check=True)
    finally:
        for p in spinners:
            p.kill()
    out = json.loads(r.stdout)
    out["compile"], out["decided"] = compile_mode, [ln for ln in r.stderr.splitlines() if ln.startswith("compile")]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20, help="the chat session's length, per case")
    ap.add_argument("--serve-minutes", type=float, default=5, help="the serve session's length, per case (0: none)")
    ap.add_argument("--reply-tokens", type=int, default=200)
    ap.add_argument("--think", type=float, default=5.0, help="seconds between a chat reply and the next message")
    ap.add_argument("--clients", type=int, default=2, help="serve: requests always in flight")
    ap.add_argument("--verbs", default="chat,serve", help="which sessions to run (serve needs --serve-minutes)")
    ap.add_argument("--busy-cores", type=int, default=1, help="other processes spinning meanwhile")
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.inner:
        print(json.dumps(session(a.inner, a.minutes, a.reply_tokens, a.think, a.clients)))
        return
    cases = []
    for verb in (v for v in a.verbs.split(",") if v == "chat" or (v == "serve" and a.serve_minutes)):
        for mode in ("auto", "off"):
            print(f"compile_policy: {verb}, compile {mode}, {a.busy_cores} busy core(s)", file=sys.stderr, flush=True)
            cases.append(run_case(verb, mode, a, a.busy_cores))
            print(json.dumps(cases[-1]["minutes"]), file=sys.stderr, flush=True)
    ratios = {}
    for verb in {c["verb"] for c in cases}:
        auto, off = (next(c for c in cases if c["verb"] == verb and c["compile"] == m) for m in ("auto", "off"))
        ratios[verb] = [round(x["tokens_per_s"] / y["tokens_per_s"], 2) if x["tokens_per_s"] and y["tokens_per_s"]
                        else None for x, y in zip(auto["minutes"], off["minutes"])]
    report = {"meta": stamp(vars(a)), "benchmark": "compile_policy", "cases": cases, "auto_over_off": ratios}
    text = json.dumps(report, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
