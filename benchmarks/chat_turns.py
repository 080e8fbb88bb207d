"""Time to first token over a multi-turn chat, with the engine resuming each turn's state (prefix reuse)
against prefilling the whole conversation every turn, in the same process on the same model.

    python benchmarks/chat_turns.py [--model PATH] [--turns 12] [--out chat_turns.json]

Each turn appends a user message to the chat-encoded conversation and a greedy reply of up to
`--reply-tokens` tokens. Both engines see the same prompts (the fresh engine's replies are used, and the
reusing engine must produce the same ones).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from meta import stamp

from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.encoding import encode_messages, parse_completion
from dsv4cli.engine import Engine, EngineOptions, SamplingParams
from dsv4cli.model import load_model
from dsv4cli.tokenizer import Tokenizer

QUESTIONS = ["What is the capital of {}?", "Tell me a story about a fox named {}.", "What is 7 plus 8?",
             "Hi there, {}!", "What sound does a cow make?", "What is the opposite of hot?"]
NAMES = ["France", "Ben", "Lily", "Japan", "Max", "Peru"]


def turn_prompt(i: int) -> str:
    return QUESTIONS[i % len(QUESTIONS)].format(NAMES[i % len(NAMES)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED_MODEL_DIR))
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--reply-tokens", type=int, default=96)
    ap.add_argument("--mtp", type=int, default=1)
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()

    tok = Tokenizer.from_dir(args.model)
    model = load_model(args.model, "cpu", torch.float32)
    params = SamplingParams(temperature=0, max_tokens=args.reply_tokens)
    engines = {"fresh": Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=4096, drafts=args.mtp)),
               "reuse": Engine(model, tok,
                               EngineOptions(max_batch=1, max_seq_len=4096, drafts=args.mtp, reuse_prefix=True))}
    for eng in engines.values():      # warm-up: first-call allocations and kernel selection
        eng.generate([tok.encode(encode_messages([{"role": "user", "content": "Hi"}]))], params)
    messages, turns = [], []
    for i in range(args.turns):
        messages.append({"role": "user", "content": turn_prompt(i)})
        prompt = tok.encode(encode_messages(messages))
        row = {"turn": i + 1, "prompt_tokens": len(prompt)}
        replies = {}
        for name, eng in engines.items():
            t0 = time.perf_counter()
            seq = eng.generate([prompt], params)[0]
            row[f"{name}_ttft_ms"] = round(1000 * seq.metrics.ttft, 2)
            row[f"{name}_wall_ms"] = round(1000 * (time.perf_counter() - t0), 2)
            row[f"{name}_cached_tokens"] = seq.metrics.cached_tokens
            replies[name] = seq.output_ids
        if replies["reuse"] != replies["fresh"]:
            sys.exit(f"turn {i + 1}: the reusing engine's reply differs from the fresh engine's")
        row["ttft_speedup"] = round(row["fresh_ttft_ms"] / row["reuse_ttft_ms"], 2)
        turns.append(row)
        text = tok.decode(replies["fresh"])
        messages.append(parse_completion(text, thinking=False))
        print(f"turn {row['turn']:2d}: prompt {row['prompt_tokens']:5d} tok ({row['reuse_cached_tokens']} reused)  "
              f"TTFT fresh {row['fresh_ttft_ms']:7.1f} ms  reuse {row['reuse_ttft_ms']:6.1f} ms  "
              f"({row['ttft_speedup']}x)", file=sys.stderr)
    result = {"meta": {**stamp(vars(args)),
                       "model": args.model, "device": "cpu", "threads": torch.get_num_threads(), "mtp": args.mtp,
                       "reply_tokens": args.reply_tokens}, "turns": turns}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
