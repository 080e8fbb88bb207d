"""The token and block verify rules side by side on the bundled models: mean acceptance length and decode
tokens/s per temperature, in one process.

    python benchmarks/verify_rules.py [--configs dspark-auto,dspark-5,mtp-3] [--temperatures 0,0.6,1]
                                      [--min-steps 2000] [--batch 4] [--max-tokens 64] [--out F]

Prompts: the held-out split of the bundled models' corpus (questions and story requests the models never
saw, chat-encoded). Each configuration's engine is built once per rule on the same loaded model (eager, one
thread, as `dsv4 chat` runs the bundled model on the CPU); per temperature, rounds of the prompts run under
each rule in turn, the same seeds for both (a busy spell on the shared machine falls on both alike), until
each rule has verified drafts in at least --min-steps sequence steps. Mean acceptance length: 1 + accepted
drafts per step that verified drafts (as `bench`); tokens/s: the decode phase (tokens after a request's
first over the time after it). Greedy (temperature 0) rows must give the same tokens under both rules.

Two runs' acceptance lengths differ by their draws as much as by their rules (a standard error of ~0.03 at
2,000 steps), so in every second round each sampled block either rule verifies is also scored by both
rules' exact expected acceptance given its drafts (`verify.expected_accepted`): their difference, averaged
over the same blocks, is the block rule's gain with a standard error of a few thousandths ("expected" in the
results; tokens/s come from the rounds not scored). The block rule is proven optimal in expected tokens per
step among lossless verifiers (Sun et al.; Thomas and Pal 2026 extend it to verifiers that read off-path
probabilities), so that gain bounds what any verifier could add on these drafts.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from meta import stamp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.corpus import heldout_set, story_requests  # noqa: E402


def prompts(tok) -> list[list[int]]:
    from dsv4cli.encoding import encode_messages

    questions = [item["question"] for item in heldout_set(seed=11, n=40)] + story_requests("heldout")
    return [tok.encode(encode_messages([{"role": "user", "content": q}], encoding=tok.encoding)) for q in questions]


class Expectations:
    """Both rules' expected accepted drafts on every block the engines verify in sampled steps, from the
    verifier's own inputs: the rule functions are wrapped to score their arguments first (rows of the step's
    active slots that verify at least one draft), in the rounds it is `on` for. `engine`: the engine stepping."""

    def __init__(self):
        self.token, self.block, self.engine, self.on = [], [], None, False

    def watch(self) -> None:
        import dsv4cli.engine.verify as v

        def scored(rule):
            def call(probs, drafts, seed, pos, q=None, limit=None):
                if not self.on:
                    return rule(probs, drafts, seed, pos, q, limit)
                keep = self.engine.runner.state.active[:drafts.shape[0]].clone()
                if limit is not None:
                    keep &= limit > 0
                self.token += v.expected_accepted(probs, drafts, q, limit)[keep].tolist()
                self.block += v.expected_accepted(probs, drafts, q, limit, block=True)[keep].tolist()
                return rule(probs, drafts, seed, pos, q, limit)
            return call
        v.verify, v.verify_block = scored(v.verify), scored(v.verify_block)

    def take(self) -> dict:
        """Mean acceptance lengths (1 + expected accepted drafts) over the blocks since the last take, the
        gain and its standard error."""
        n = len(self.token)
        gain = torch.tensor(self.block, dtype=torch.float64) - torch.tensor(self.token, dtype=torch.float64)
        out = {"blocks": n, "token": 1 + sum(self.token) / max(n, 1), "block": 1 + sum(self.block) / max(n, 1),
               "gain": gain.mean().item() if n else 0.0, "gain_se": (gain.std() / n ** 0.5).item() if n > 1 else 0.0}
        self.token, self.block = [], []
        return out


def run(engine, batch: list[list[int]], temperature: float, max_tokens: int, seed: int) -> dict:
    from dsv4cli.engine import SamplingParams

    seqs = [engine.submit(p, SamplingParams(temperature=temperature, seed=seed + i, max_tokens=max_tokens))
            for i, p in enumerate(batch)]
    while engine.has_work():
        engine.step()
    return {"steps": sum(s.metrics.drafts for s in seqs), "accepted": sum(s.metrics.accepted_tokens for s in seqs),
            "tokens": sum(s.metrics.output_tokens - 1 for s in seqs),
            "seconds": sum(s.metrics.t_last - s.metrics.t_first for s in seqs),
            "outputs": [s.output_ids for s in seqs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="dspark-auto,dspark-5,mtp-3", help="dspark-<K|auto>, mtp-<K>")
    ap.add_argument("--temperatures", default="0,0.6,1")
    ap.add_argument("--min-steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from dsv4cli.config import BUNDLED_MODEL_DIR
    from dsv4cli.engine import Engine, EngineOptions
    from dsv4cli.model import load_model
    from dsv4cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    items = prompts(tok)
    batches = [items[i:i + args.batch] for i in range(0, len(items), args.batch)]
    results = []
    expectations = Expectations()
    expectations.watch()
    for config in args.configs.split(","):
        kind, _, depth = config.rpartition("-")
        path = BUNDLED_MODEL_DIR if kind == "dspark" else BUNDLED_MODEL_DIR.with_name("dsv4-tiny-mtp")
        model = load_model(path, dtype=torch.float32)
        drafts = depth if depth == "auto" else int(depth)
        engines = {rule: Engine(model, tok, EngineOptions(max_batch=args.batch, max_seq_len=512, drafts=drafts,
                                                          verify=rule)) for rule in ("token", "block")}
        with torch.no_grad():
            for e in engines.values():          # warm-up: auto measures each length's cost
                expectations.engine = e
                run(e, batches[0], 1.0, args.max_tokens, 0)
            expectations.take()
            for temperature in map(float, args.temperatures.split(",")):
                totals = {rule: {"steps": 0, "accepted": 0, "tokens": 0, "seconds": 0.0} for rule in engines}
                rounds, t0 = 0, time.perf_counter()
                while min(t["steps"] for t in totals.values()) < args.min_steps:
                    expectations.on = rounds % 2 == 1       # the scoring's time stays out of tokens/s
                    for i, batch in enumerate(batches):
                        outs = {}
                        order = list(engines) if (rounds + i) % 2 == 0 else list(engines)[::-1]
                        for rule in order:
                            expectations.engine = engines[rule]
                            r = run(engines[rule], batch, temperature, args.max_tokens, 1000 * rounds + 10 * i)
                            outs[rule] = r.pop("outputs")
                            for key, value in r.items():
                                if key in ("steps", "accepted") or not expectations.on:
                                    totals[rule][key] += value
                        if temperature == 0:
                            assert outs["token"] == outs["block"], "greedy output differs between the rules"
                    rounds += 1
                row = {"config": config, "temperature": temperature, "rounds": rounds}
                for rule, t in totals.items():
                    row[rule] = {"steps": t["steps"], "mean_acceptance_length": 1 + t["accepted"] / max(t["steps"], 1),
                                 "tokens_per_s": t["tokens"] / t["seconds"]}
                row["block_minus_token_length"] = (row["block"]["mean_acceptance_length"]
                                                   - row["token"]["mean_acceptance_length"])
                row["block_over_token_speed"] = row["block"]["tokens_per_s"] / row["token"]["tokens_per_s"]
                row["expected"] = expectations.take()
                results.append(row)
                x = row["expected"]
                print(f"{config} T {temperature:g}: length token {row['token']['mean_acceptance_length']:.3f} "
                      f"block {row['block']['mean_acceptance_length']:.3f} "
                      f"({row['block_minus_token_length']:+.3f}; on the same {x['blocks']} blocks "
                      f"{x['token']:.3f} / {x['block']:.3f}, {x['gain']:+.4f} +- {x['gain_se']:.4f}), speed "
                      f"block/token {row['block_over_token_speed']:.3f} ({rounds} rounds, "
                      f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    out = json.dumps({"meta": stamp(vars(args)), "benchmark": "verify_rules", "results": results}, indent=1)
    if args.out:
        Path(args.out).write_text(out + "\n")
    else:
        print(out)


if __name__ == "__main__":
    main()
