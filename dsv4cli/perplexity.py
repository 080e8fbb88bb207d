"""`dsv4 perplexity FILE`: the model's perplexity on a text, scored in windows as llama-perplexity scores it,
and the KL divergence of one run (a quantisation, dtype, device) against another's saved logprobs.

The text is tokenized whole, BOS first, and cut into windows of `ctx` tokens starting every `stride` tokens;
each window scores the tokens no earlier window scored, every one after its own first (with stride = ctx the
windows are disjoint and each one's first token goes unscored). Windows run as requests of the engine
(`SamplingParams.prompt_logprobs`, nothing generated), `max_batch` of them at a time, so a window's logits are
never held whole: the engine scores each prefill chunk as it runs.

A logits file (`--save-logits`) holds, per scored token, its logprob and the `top_k` most likely ids with their
logprobs: a JSON header line, then one record per window, each written with one append (a killed run resumes
where it stopped). `--kl-divergence FILE` scores the same windows with the file's ids also scored
(`SamplingParams.score_ids`) and compares the two distributions over those ids plus the rest of the vocabulary
as one outcome: the KL divergence of that coarser pair, a lower bound of the full one (within the rest's
mass, which the report shows).
"""
import dataclasses
import hashlib
import json
import math
import os
import struct
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import typer

from dsv4cli.config import Settings
from dsv4cli.errors import RunError, UsageError
from dsv4cli.options import CliOptions, model_options

FORMAT = "dsv4-logits/1"
RECORD = struct.Struct("<iii")      # a record's window, scored tokens m, ids per token k


@dataclass(frozen=True)
class Window:
    start: int      # the window is tokens [start, end)
    end: int
    first: int      # the first token it scores (the ones before were scored by earlier windows, or are its first)


def windows(n: int, ctx: int, stride: int) -> list[Window]:
    """The windows over n tokens: every token from 1 on scored once."""
    out, scored_to, start = [], 1, 0
    while True:
        end = min(start + ctx, n)
        first = max(start + 1, scored_to)
        if end > first:
            out.append(Window(start, end, first))
        scored_to = end
        if end >= n:
            return out
        start += stride


@dataclass
class Scores:
    """What the windows scored so far: the NLL's sum and sum of squares (for its standard error)."""
    nll: float = 0.0
    squares: float = 0.0
    tokens: int = 0

    def add(self, logprobs: list[float]) -> None:
        self.nll -= sum(logprobs)
        self.squares += sum(v * v for v in logprobs)
        self.tokens += len(logprobs)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    @property
    def ppl_stderr(self) -> float:
        """The perplexity's standard error from the per-token NLL's (the delta method, as llama-perplexity)."""
        if self.tokens < 2:
            return float("nan")
        mean = self.nll / self.tokens
        var = max(self.squares / self.tokens - mean * mean, 0.0) * self.tokens / (self.tokens - 1)
        return self.ppl * math.sqrt(var / self.tokens)


class LogitsFile:
    """A logits file: its header, and the records of the windows it holds (window -> (logprobs [m], ids [m*k],
    their logprobs [m*k]))."""

    def __init__(self, path: Path, header: dict, records: dict[int, tuple[array, array, array]], end: int):
        self.path, self.header, self.records, self.end = path, header, records, end

    @classmethod
    def read(cls, path: Path, flag: str) -> "LogitsFile":
        """The file's header and complete records (a record cut short by a killed run is left out; `end` is
        where the complete ones end)."""
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UsageError(f"{flag} {path}: cannot read: {e.strerror}") from None
        line, newline, body = data.partition(b"\n")
        try:
            header = json.loads(line) if newline else None
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise UsageError(f"{flag} {path}: not a logits file written by `dsv4 perplexity --save-logits`")
        records, at = {}, len(line) + 1
        while at + RECORD.size <= len(data):
            window, m, k = RECORD.unpack_from(data, at)
            size = RECORD.size + 4 * (m + 2 * m * k)
            if m < 0 or k != header["top_k"] or at + size > len(data):
                break
            parts = []
            for count, code in ((m, "f"), (m * k, "i"), (m * k, "f")):
                a = array(code)
                start = at + RECORD.size + sum(4 * len(p) for p in parts)
                a.frombytes(data[start:start + 4 * count])
                parts.append(a)
            if sys.byteorder != "little":
                for a in parts:
                    a.byteswap()
            records[window], at = tuple(parts), at + size
        return cls(path, header, records, at)

    @staticmethod
    def record(window: int, logprobs: list[float], ids: list[list[int]], top: list[list[float]]) -> bytes:
        parts = [array("f", logprobs), array("i", [t for row in ids for t in row]),
                 array("f", [v for row in top for v in row])]
        if sys.byteorder != "little":
            for a in parts:
                a.byteswap()
        return RECORD.pack(window, len(logprobs), len(ids[0]) if ids else 0) + b"".join(a.tobytes() for a in parts)


def read_text(file: str) -> str:
    try:
        raw = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
    except OSError as e:
        raise UsageError(f"{file}: cannot read: {e.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{'stdin' if file == '-' else file}: not UTF-8 text") from None


def kl_stats(base: LogitsFile, runs: dict[int, list], plan: list[Window]) -> dict:
    """The KL divergence per scored token of this run against the base file, over the base's top ids and the
    rest: mean, percentiles, max; top-1 agreement; the base's perplexity."""
    k = base.header["top_k"]
    kls, agree, base_scores, rest = [], 0, Scores(), 0.0
    for w, _ in enumerate(plan):
        lps, ids, tops = base.records[w]
        base_scores.add(list(lps))
        for i, entry in enumerate(runs[w]):
            p = [math.exp(v) for v in tops[i * k:(i + 1) * k]]
            q = [math.exp(v) for v in entry.given]
            rest_p, rest_q = max(1.0 - sum(p), 0.0), max(1.0 - sum(q), 1e-30)
            kl = sum(pi * (lp - lq) for pi, lp, lq in zip(p, tops[i * k:(i + 1) * k], entry.given) if pi > 0)
            kl += rest_p * (math.log(rest_p) - math.log(rest_q)) if rest_p > 0 else 0.0
            kls.append(max(kl, 0.0))
            agree += entry.top[0][0] == ids[i * k]
            rest += rest_p
    kls.sort()

    def pct(p: float) -> float:
        return kls[min(len(kls) - 1, int(p / 100 * len(kls)))]

    return {"kl_mean": sum(kls) / len(kls), "kl_median": pct(50), "kl_p90": pct(90), "kl_p95": pct(95),
            "kl_p99": pct(99), "kl_max": kls[-1], "top1_agreement": agree / len(kls), "base_ppl": base_scores.ppl,
            "base_rest_mass": rest / len(kls)}


def run_perplexity(s: Settings, file: str, ctx: int, stride: int | None, save: Path | None, kl: Path | None,
                   top_k: int) -> int:
    from dsv4cli.engine import SamplingParams
    from dsv4cli.loading import load_engine, model_config

    stride = stride or ctx
    if ctx < 2:
        raise UsageError(f"--ctx {ctx}: a window needs at least 2 tokens")
    if not 1 <= stride <= ctx:
        raise UsageError(f"--stride {stride}: must be 1..{ctx} (--ctx)")
    if save is not None and kl is not None:
        raise UsageError("--save-logits: not with --kl-divergence; save the reference run's logits first")
    if ctx + 1 > (limit := model_config(s).max_position_embeddings):    # a window, and its first reply's position
        raise UsageError(f"--ctx {ctx}: at most {limit - 1} (the model's max_position_embeddings - 1)")
    base = LogitsFile.read(kl, "--kl-divergence") if kl is not None else None
    text = read_text(file)
    # the windows are the requests: no drafting, each window's prompt held whole
    engine = load_engine(dataclasses.replace(s, drafts=0, max_seq_len=ctx + 1), "perplexity")
    out = None
    try:
        tokens = [engine.tok.bos_id, *engine.tok.encode(text)]
        if len(tokens) < 2:
            raise UsageError(f"{file}: the text has no token to score")
        plan = windows(len(tokens), ctx, stride)
        header = {"format": FORMAT, "model": s.model_name, "tokens": len(tokens), "ctx": ctx, "stride": stride,
                  "tokens_sha256": hashlib.sha256(array("i", tokens).tobytes()).hexdigest(),
                  "top_k": base.header["top_k"] if base else top_k}
        if base is not None:
            same = {key: base.header.get(key) for key in ("tokens", "ctx", "stride", "tokens_sha256")}
            if same != {key: header[key] for key in same} or len(base.records) != len(plan):
                raise UsageError(f"--kl-divergence {kl}: saved for another text or windows (ctx {same['ctx']}, stride "
                                 f"{same['stride']}, {same['tokens']} tokens, {len(base.records)} of its windows)")
        out = open_logits(save, header) if save is not None else None
        scores, runs, t0 = Scores(), {}, time.perf_counter()
        done = set(out.records) if out is not None else set()
        for w in done:
            scores.add(list(out.records[w][0]))
        todo = [w for w in range(len(plan)) if w not in done]
        n_top = top_k if save else 1 if base else 0      # the KL run: its top-1, for the agreement
        with WindowBar(len(plan), len(done)) as bar:
            pending, in_flight = iter(todo), {}
            while True:
                while len(in_flight) < 2 * engine.max_batch and (w := next(pending, None)) is not None:
                    win = plan[w]
                    given = None
                    if base is not None:
                        ids, k = base.records[w][1], header["top_k"]
                        given = [[0] * k] * (win.first - win.start) + [
                            list(ids[i * k:(i + 1) * k]) for i in range(win.end - win.first)]
                    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=n_top, score_ids=given)
                    seq = engine.submit(tokens[win.start:win.end], params)
                    in_flight[id(seq)] = (w, seq)
                if not in_flight:
                    break
                for event in engine.step():
                    if not event.finished or id(event.seq) not in in_flight:
                        continue
                    w, seq = in_flight.pop(id(event.seq))
                    if seq.error is not None:
                        raise RunError(seq.error)
                    entries = seq.prompt_logprobs[plan[w].first - plan[w].start:]
                    scores.add([e.logprob for e in entries])
                    if out is not None:
                        out.append(LogitsFile.record(w, [e.logprob for e in entries], [[t for t, _ in e.top]
                                   for e in entries], [[v for _, v in e.top] for e in entries]))
                    if base is not None:
                        runs[w] = entries
                    bar.advance(f"ppl {scores.ppl:.4f}")
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
        if out is not None:
            out.close()
    result = {"ppl": scores.ppl, "ppl_stderr": scores.ppl_stderr, "nll": scores.nll, "mean_nll":
              scores.nll / scores.tokens, "tokens": scores.tokens, "windows": len(plan), "ctx": ctx, "stride": stride,
              "model": s.model_name, "seconds": round(seconds, 3)}
    if base is not None:
        result |= kl_stats(base, runs, plan)
        result["delta_ppl"] = result["ppl"] - result["base_ppl"]
    if s.json:
        print(json.dumps(result))
        return 0
    print(f"perplexity: {result['ppl']:.4f} ± {result['ppl_stderr']:.4f} · mean NLL {result['mean_nll']:.5f} nats · "
          f"{scores.tokens} tokens scored in {len(plan)} windows of {ctx} (stride {stride}) · {seconds:.1f} s")
    if base is not None:
        print(f"KL divergence vs {kl}: mean {result['kl_mean']:.6f} · median {result['kl_median']:.6f} · p90 "
              f"{result['kl_p90']:.6f} · p99 {result['kl_p99']:.6f} · max {result['kl_max']:.6f} nats")
        print(f"top-1 agreement {100 * result['top1_agreement']:.2f}% · Δppl {result['delta_ppl']:+.4f} (base "
              f"{result['base_ppl']:.4f}) · the base's top {header['top_k']} leave {result['base_rest_mass']:.2e} of "
              f"the mass on average")
    return 0


class AppendFile:
    """The logits file being written: its records so far (a resumed run's), appended one write each."""

    def __init__(self, path: Path, records: dict, end: int):
        self.records = records
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.truncate(self.fd, end)          # a record a killed run cut short
        except OSError as e:
            raise UsageError(f"--save-logits {path}: cannot write: {e.strerror}") from None

    def append(self, record: bytes) -> None:
        os.write(self.fd, record)

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


def open_logits(path: Path, header: dict) -> AppendFile:
    """The logits file to save into: a new one, or one of the same text, windows and top_k to resume."""
    if path.exists() and path.stat().st_size:
        held = LogitsFile.read(path, "--save-logits")
        if held.header != header:
            raise UsageError(f"--save-logits {path}: holds another run's logits (text, model, windows or top-k "
                             f"differ); remove it or choose another file")
        return AppendFile(path, held.records, held.end)
    try:
        path.write_text(json.dumps(header) + "\n")
    except OSError as e:
        raise UsageError(f"--save-logits {path}: cannot write: {e.strerror}") from None
    return AppendFile(path, {}, len(json.dumps(header)) + 1)


class WindowBar:
    """A progress bar over the windows on stderr when it is a terminal (else nothing)."""

    def __init__(self, total: int, done: int):
        self.bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("perplexity"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                TextColumn("{task.fields[stats]}"), transient=True)
            self.task = self.bar.add_task("windows", total=total, completed=done, stats="")

    def __enter__(self) -> "WindowBar":
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def advance(self, stats: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, stats=stats)


@model_options("json")
def perplexity(
    opts: CliOptions,
    file: str = typer.Argument(..., help="The text to score (UTF-8; - for stdin)"),
    ctx: int = typer.Option(2048, "--ctx", help="Tokens per window"),
    stride: int = typer.Option(None, "--stride", help="Tokens between window starts (default: --ctx, no overlap)"),
    save_logits: Path = typer.Option(None, "--save-logits", help="Keep each scored token's top logprobs in this file "
                                     "(resumes a file of the same run)", dir_okay=False),
    kl_divergence: Path = typer.Option(None, "--kl-divergence", help="Compare against a --save-logits file: KL "
                                       "divergence, top-1 agreement, Δppl", dir_okay=False),
    save_top_k: int = typer.Option(20, "--save-top-k", min=1, max=20, help="Logprobs kept per token by "
                                   "--save-logits (the most likely ids')"),
) -> int:
    settings, _ = opts.resolve()
    return run_perplexity(settings, file, ctx, stride, save_logits, kl_divergence, save_top_k)
