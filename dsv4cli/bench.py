"""`dsv4 bench`: decode speed of plain vs speculative decoding, in one process.

Every configuration (drafts verified per step x batch x prompt length) runs on the same loaded model; speed-ups
are ratios against plain decoding (K = 0, eager) measured in the same run. A 0731 checkpoint's DSpark drafter
runs at each fixed length and at `auto` (the lengths it chose are reported); `--peer-model` runs a second
checkpoint alongside (by default, beside the bundled DSpark model, the bundled preview-layout one, whose MTP
layer chains to each depth). When transformers is installed its `generate` runs on the same weights
(dequantised to float if the checkpoint is W8A8; trunk only: it has no drafter) as a peer. `--temperatures`
and `--verify-rules` add sampled runs (seeded) and the verify rules to compare, each against plain decoding at its
temperature.
`--under-load N`: the scheduler instead, an N-token prompt arriving while streams decode.
"""
import dataclasses
import itertools
import json
import re
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import torch
import typer
from rich.console import Console
from rich.table import Table

from dsv4cli import platforms
from dsv4cli.config import BUNDLED_MODEL_DIR, SPEC, Settings
from dsv4cli.encoding import encode_messages
from dsv4cli.engine import EngineAPI, ModelInfo, SamplingParams
from dsv4cli.engine.compiled import cache_dir
from dsv4cli.errors import UsageError
from dsv4cli.loading import cpu_cores, load_engine, load_weights, pick_device
from dsv4cli.model.checkpoint import save_checkpoint
from dsv4cli.model.drafters import drafter_kind, drafter_named
from dsv4cli.model.quant import dequantized
from dsv4cli.options import CliOptions, model_options
from dsv4cli.terminal import table_console

# the configurations `dsv4 bench` runs unless told: all of them, or on a CPU of a few cores (where eager
# decoding of a batch of 16 long prompts takes minutes per depth) a set that ends in minutes
FULL = {"depths": "0,1,2,3,4,5,auto", "batches": "1,4,16", "prompts": "short,long"}
SMALL_CPU = {"depths": "0,1,3,5,auto", "batches": "1,4", "prompts": "short"}
SMALL_CPU_CORES = 8

QUESTIONS = ["What is the capital of France?", "What is 7 plus 12?", "What does a cow say?",
             "What color is the sky?", "Tell me a short story.", "What is the opposite of hot?",
             "What is 15 minus 4?", "What is the capital of Japan?"]


def bench_prompts(tok, kind: str, n: int) -> list[list[int]]:
    """n chat prompts: short single questions, or long ones (a ~400-token earlier conversation)."""
    prompts = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        messages = [{"role": "user", "content": q}]
        if kind == "long":
            history = []
            for j in range(12):
                history += [{"role": "user", "content": QUESTIONS[(i + j) % len(QUESTIONS)]},
                            {"role": "assistant", "content": "Let me think about that. " * 3}]
            messages = history + messages
        prompts.append(tok.encode(encode_messages(messages, encoding=tok.encoding)))
    return prompts


def run_config(engine: EngineAPI, prompts, max_tokens: int, temperature: float = 0.0) -> dict:
    """Decode-phase speed: tokens after each request's first over the wall time after admission (sampled
    requests seeded by their index)."""
    seqs = [engine.submit(p, SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    while any(not s.output_ids for s in seqs):  # admits the batch (prefill within the step budget)
        engine.step()
    t0, steps = time.perf_counter(), 0
    done_before = sum(len(s.output_ids) for s in seqs)
    while engine.has_work():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) for s in seqs) - done_before
    drafts = sum(s.metrics.drafts for s in seqs)
    draft_tokens = sum(s.metrics.draft_tokens for s in seqs)
    accepted = sum(s.metrics.accepted_tokens for s in seqs)
    return {"tokens_per_s": tokens / dt, "step_ms": 1000 * dt / max(steps, 1),
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "ttft_ms": 1000 * sum(s.metrics.ttft for s in seqs) / len(seqs), "decode_tokens": tokens}


LOAD_TEXT = "Once upon a time, a little fox named Ben lived by the river. Every morning he looked for berries. "


def first_token_s(engine: EngineAPI, prompt: list[int]) -> float:
    """TTFT of `prompt` on `engine`."""
    seq = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while not seq.output_ids:
        engine.step()
    return seq.metrics.ttft


def under_load(engine: EngineAPI, streams: list[list[int]], arriving: list[list[int]], around: int) -> dict:
    """`streams` decode for `around` steps, then the `arriving` prompts arrive together; after the last one's
    first token, `around` more steps. Their TTFT (the slowest's), and the running streams' inter-token gaps
    (time between a stream's consecutive events, each a step's committed tokens) over all those steps."""
    params = SamplingParams(temperature=0, max_tokens=engine.max_seq_len, ignore_eos=True)
    running = [engine.submit(p, params) for p in streams]
    while any(not s.output_ids for s in running):
        engine.step()
    times = {s.id: [] for s in running}

    def step() -> None:
        events = engine.step()
        now = time.perf_counter()
        for e in events:
            if e.seq.id in times:
                times[e.seq.id].append(now)

    for _ in range(around):
        step()
    new = [engine.submit(p, SamplingParams(temperature=0, max_tokens=around + 1, ignore_eos=True)) for p in arriving]
    steps = 0
    while not all(s.output_ids for s in new):
        step()
        steps += 1
    for _ in range(around):
        step()
    for s in running + new:
        engine.cancel(s)
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    median = statistics.median(gaps)
    return {"ttft_s": max(s.metrics.ttft for s in new), "prefill_steps": steps, "gap_max_ms": 1000 * max(gaps),
            "gap_median_ms": 1000 * median, "gap_max_vs_median": max(gaps) / median}


def bench_under_load(engine: EngineAPI, streams: int, prompt_tokens: int, around: int) -> dict:
    """A `prompt_tokens` prompt arriving while `streams` requests decode (`under_load`), its TTFT also
    against the same prompt's on the idle engine."""
    eng = engine.resized(streams + 1, engine.draft_depth)
    prompt = eng.tok.encode(LOAD_TEXT * (prompt_tokens // 10 + 1))[:prompt_tokens]
    first_token_s(eng, prompt[:8])                                     # warm-up
    idle = min(first_token_s(eng, prompt) for _ in range(2))
    run = under_load(eng, bench_prompts(eng.tok, "short", streams), [prompt], around)
    return {"streams": streams, "drafts": eng.draft_depth, "prompt_tokens": len(prompt), **run,
            "idle_ttft_s": idle, "ttft_vs_idle": run["ttft_s"] / idle}


def float_copy(settings: Settings, out_dir) -> None:
    """The model's trunk in the official float layout (W8A8 linears dequantised), for transformers (which has
    no DSpark drafter: a 0731 checkpoint goes without its stages)."""
    model, _ = load_weights(settings, torch.device("cpu"))
    cfg = model.cfg
    kind = drafter_kind(cfg)
    trunk_only = kind is not None and not kind.in_transformers
    state = dequantized(model.state_dict())
    if trunk_only:
        state = {name: t for name, t in state.items() if not name.startswith("mtp.")}
    config = {k: v for k, v in cfg.raw.items() if k != "quantization_config" and not k.startswith("dspark_")}
    if trunk_only:
        config |= {"compress_ratios": list(cfg.compress_ratios[: cfg.n_layers]), "num_nextn_predict_layers": 0}
    save_checkpoint({name: t.float() for name, t in state.items()}, config, out_dir)


def run_transformers(settings: Settings, prompts, max_tokens: int) -> dict | None:
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        float_copy(settings, tmp)
        model = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    total, elapsed = 0, 0.0
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, do_sample=False)          # prefill-only pass, timed apart
            t0 = time.perf_counter()
            first = model.generate(ids, max_new_tokens=1, do_sample=False)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
            elapsed += time.perf_counter() - t0 - t_first
        total += out.shape[1] - first.shape[1]
    return {"tokens_per_s": total / elapsed}


# a kernel call in generated wrapper code: inductor's C++ / Triton kernels, library (extern) kernels,
# aten fallbacks and custom ops
_CALL = re.compile(r"^\s*(?:\w+ = )?(?:cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?"
                   r"|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.MULTILINE)


def kernel_calls(sources: list[str]) -> int:
    """Kernel calls in a compiled step's generated wrapper code (each runs once per call of the step)."""
    return sum(len(_CALL.findall(source)) for source in sources)


def eager_launches(engine: EngineAPI) -> int:
    """Leaf ops of one eager decode step (each a kernel launch), counted by the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and not e.cpu_children)


def launches_per_step(engine: EngineAPI, prompt: list[int]) -> int:
    """Kernel launches of one decode step: leaf ops when eager, kernel calls of the generated code when
    compiled (C++ / Triton kernels, library GEMMs, custom ops: the host-routed experts count as one)."""
    seq = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()                                  # admission (the first token)
    if engine.status().compile is None:
        n = eager_launches(engine)
    else:
        engine.step()
        n = max(kernel_calls(list(code)) for code in engine.status().decode_code)
    engine.cancel(seq)
    return n


def depths_for(info: ModelInfo, depths: list) -> list:
    """The depths a checkpoint's drafter runs at: up to its block (DSpark's), auto where confidences choose
    the drafts verified (DSpark; the MTP layer's auto is 1), none but 0 without a drafter."""
    kind = drafter_named(info.drafter)
    if kind is None:
        return [d for d in depths if d == 0]

    def runs(depth) -> bool:
        if depth == "auto":         # a setting of its own where confidences choose the drafts verified
            return kind.confidence
        return not info.block_size or depth <= info.block_size

    return [d for d in depths if runs(d)]


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What a bench run measures: every combination of these (a verify rule only where it can matter: sampled
    runs that draft)."""
    depths: list
    batches: list[int]
    kinds: list[str]
    max_tokens: int
    compile_modes: tuple[bool, ...] = (False,)
    temperatures: tuple[float, ...] = (0.0,)
    rules: tuple[str, ...] = ("block",)


def configurations(engine: EngineAPI, peer: EngineAPI | None, sweep: Sweep, batch: int):
    """(engine, compile, depth, temperature, verify rule or None) for one batch size, in the order they run."""
    for model_engine in [engine, *([peer] if peer is not None else [])]:
        for compile_on in sweep.compile_modes:
            for depth in depths_for(model_engine.model_info, sweep.depths):
                if model_engine is peer and depth == 0:     # the peer's trunk is the same: plain ran above
                    continue
                for temperature in sweep.temperatures:
                    for rule in sweep.rules if depth and temperature else (None,):
                        yield model_engine, compile_on, depth, temperature, rule


class Progress:
    """Where a bench run is: `start(label)` at each of `total` configurations, `note(text)` within one (a
    step shape compiling: minutes each on a small CPU). A rich bar on a terminal's stderr (configurations
    done, elapsed, an estimate of what is left), else a line on stderr per configuration and note."""

    def __init__(self, total: int, bar=None):
        self.total, self.bar, self.done, self.label, self.t0 = total, bar, 0, "", time.perf_counter()
        self.task = bar.add_task("", total=total) if bar is not None else None

    def start(self, label: str) -> None:
        if self.label:
            self.done += 1
            if self.bar is not None:
                self.bar.advance(self.task)
        self.label, self.t0 = label, time.perf_counter()
        self._show(label)

    def note(self, text: str) -> None:
        """Within the configuration, with the time spent on it so far."""
        spent = int(time.perf_counter() - self.t0)
        self._show(f"{self.label}: {text} ({spent // 60}:{spent % 60:02d} into it)")

    def _show(self, line: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=line)
        else:
            print(f"bench [{self.done + 1}/{self.total}] {line}", file=sys.stderr, flush=True)


@contextmanager
def progress(total: int):
    """A Progress for `total` configurations (a cold compile can take minutes: the run says where it is)."""
    if not sys.stderr.isatty():
        yield Progress(total)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.progress import Progress as Bar
    with Bar(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
             TimeRemainingColumn(), TextColumn("{task.description}"), console=Console(stderr=True),
             transient=True) as bar:
        yield Progress(total, bar)


def bench(engine: EngineAPI, sweep: Sweep, hf: Settings | None, peer: EngineAPI | None = None) -> list[dict]:
    """Every configuration's row; `hf`: the settings whose model transformers also runs (None: it doesn't)."""
    rows = []
    total = sum(len(list(configurations(engine, peer, sweep, b))) + (hf is not None and b == 1)
                for b in sweep.batches) * len(sweep.kinds)
    with progress(total) as shown:
        for kind in sweep.kinds:
            for batch in sweep.batches:
                rows += bench_batch(engine, peer, sweep, batch, kind, hf, shown)
    return rows


def bench_batch(engine, peer, sweep: Sweep, batch: int, kind: str, hf: Settings | None, shown: Progress) -> list[dict]:
    """One batch size and prompt kind: every configuration, then transformers at batch 1."""
    rows, base = [], {}         # base: plain decoding's tokens/s at each temperature
    prompts = bench_prompts(engine.tok, kind, batch)
    max_tokens = sweep.max_tokens
    for model_engine, compile_on, depth, temperature, rule in configurations(engine, peer, sweep, batch):
        name = (model_engine.model_info.drafter or "plain") if depth else "plain"
        shown.start(f"{name} {'auto' if depth == 'auto' else f'K {depth}'}, batch {batch}, {kind} prompt"
                    f"{f', T {temperature:g}' if temperature else ''}{f', {rule} verify' if rule else ''}"
                    f"{', compiled' if compile_on else ''}")
        eng = model_engine.resized(batch, depth, compile_on, rule)
        if compile_on:      # each step shape compiles at its first step: say which
            shapes = itertools.count(1)
            eng.on_compile(lambda decode, how, shapes=shapes: shown.note(
                f"{how} step shape {next(shapes)} ({'decode' if decode else 'prefill'})"))
        t0 = time.perf_counter()
        # warm-up: compiles the batch's step and chunk shapes; auto's, every length's as it
        # measures them (a step that compiles is not a measure)
        run_config(eng, prompts, 2 if depth != "auto" else 8 * (eng.draft_depth + 2), temperature)
        warmup_s = time.perf_counter() - t0
        r = run_config(eng, prompts, max_tokens, temperature)
        if depth == 0 and not compile_on:
            base[temperature] = r["tokens_per_s"]
        launches = launches_per_step(eng, prompts[0])
        info, status = eng.model_info, eng.status()
        layers = info.layers + (info.drafter_layers if eng.draft_depth else 0)
        r.update(impl="dsv4", model=eng.model_info.drafter or "plain", compile=compile_on, drafts=depth,
                 temperature=temperature, verify=rule, batch=batch, prompt=kind, prompt_tokens=len(prompts[0]),
                 speedup=r["tokens_per_s"] / base[temperature] if base.get(temperature) else None,
                 warmup_s=warmup_s,
                 launches_per_step=launches, launches_per_layer=launches / layers,
                 recompiles=status.recompiles, draft_lengths=status.draft_lengths)
        rows.append(r)
    if hf is not None and batch == 1:
        shown.start(f"transformers generate, batch 1, {kind} prompt")
        peer_run = run_transformers(hf, prompts, max_tokens)
        if peer_run:
            rows.append({**peer_run, "impl": "transformers", "model": "plain", "compile": False, "drafts": 0,
                         "temperature": 0.0, "verify": None, "batch": 1, "prompt": kind,
                         "prompt_tokens": len(prompts[0]),
                         "speedup": peer_run["tokens_per_s"] / base[0.0] if base.get(0.0) else None})
    return rows


def render(rows: list[dict], console: Console) -> None:
    table = Table("impl", "drafter", "compile", "prompt", "batch", "K", "T", "verify", "tok/s", "step ms", "TTFT ms",
                  "accept", "mean len", "launches/layer", "vs K=0")
    def fmt(r, key, spec):
        return "-" if r.get(key) is None else format(r[key], spec)

    for r in rows:
        table.add_row(r["impl"], r["model"], "on" if r["compile"] else "off", f"{r['prompt']} ({r['prompt_tokens']})",
                      str(r["batch"]), str(r["drafts"]), f"{r['temperature']:g}", r["verify"] or "-",
                      fmt(r, "tokens_per_s", ".1f"), fmt(r, "step_ms", ".1f"),
                      fmt(r, "ttft_ms", ".1f"), fmt(r, "acceptance_rate", ".2f"),
                      fmt(r, "mean_acceptance_length", ".2f"), fmt(r, "launches_per_layer", ".0f"),
                      fmt(r, "speedup", ".2f") + "x")
    console.print(table)


def render_under_load(r: dict, console: Console) -> None:
    table = Table("streams", "drafts", "prompt", "TTFT s", "idle TTFT s", "vs idle", "gap median ms",
                  "gap max ms", "max / median")
    table.add_row(str(r["streams"]), str(r["drafts"]), str(r["prompt_tokens"]), f"{r['ttft_s']:.2f}",
                  f"{r['idle_ttft_s']:.2f}", f"{r['ttft_vs_idle']:.2f}x", f"{r['gap_median_ms']:.1f}",
                  f"{r['gap_max_ms']:.1f}", f"{r['gap_max_vs_median']:.2f}x")
    console.print(table)


def parse_temperatures(text: str) -> list[float]:
    """Comma-separated temperatures, each a valid `temperature` setting."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(SPEC["temperature"].problem(v) for v in values):
        raise UsageError(f"--temperatures: expected comma-separated numbers in [0, 100], got {text!r}")
    return list(dict.fromkeys(values))


def parse_list(text: str, name: str, lo: int, hi: int | None = None, allow_empty: bool = False) -> list[int]:
    """Comma-separated integers, each in [lo, hi]."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{name}: expected comma-separated integers (or auto), got {text!r}") from None
    if allow_empty and not values:
        return []
    if not values or min(values) < lo or hi is not None and max(values) > hi:
        rule = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise UsageError(f"{name}: expected integers {rule}, got {text!r}")
    return values


@model_options()
def bench_command(
    opts: CliOptions,
    depths: str = typer.Option(None, "--depths", show_default=False,
                               help="Drafts verified per step to compare (0 = plain; auto: DSpark's choice per "
                                    f"step) [default: {FULL['depths']}; a small CPU: {SMALL_CPU['depths']}]"),
    peer_model: str = typer.Option(None, "--peer-model",
                                   help="A second checkpoint to run alongside (default, with the bundled model: its "
                                        "preview-layout twin, dsv4-tiny-mtp)"),
    batches: str = typer.Option(None, "--batches", show_default=False,
                                help=f"Batch sizes [default: {FULL['batches']}; a small CPU: {SMALL_CPU['batches']}]"),
    prompts: str = typer.Option(None, "--prompts", show_default=False,
                                help=f"Prompt lengths: short, long [default: {FULL['prompts']}; a small CPU: "
                                     f"{SMALL_CPU['prompts']}]"),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON"),
    no_hf: bool = typer.Option(False, "--no-transformers", help="Skip the transformers peer"),
    load_prompt: int = typer.Option(0, "--under-load", min=0, metavar="N",
                                    help="Instead: the TTFT of an N-token prompt arriving while --streams "
                                         "requests decode (vs the idle engine's) and the streams' inter-token "
                                         "gaps, over --max-tokens steps before and after it"),
    streams: int = typer.Option(8, "--streams", min=1, help="Running streams, with --under-load"),
    temperatures: str = typer.Option("0", "--temperatures", help="Sampling temperatures to run at (seeded "
                                     "requests; plain decoding at each is its baseline), e.g. 0,0.6,1"),
    rules: str = typer.Option(None, "--verify-rules", show_default=False, help="Verify rules to compare where "
                              "sampled drafts are verified, e.g. token,block [default: --verify's]"),
) -> int:
    settings, sources = opts.resolve()
    given = {"depths": depths, "batches": batches, "prompts": prompts}
    device = pick_device(settings.device)
    small = platforms.for_device(device).on_host_cores and cpu_cores() <= SMALL_CPU_CORES
    chosen = {name: value or (SMALL_CPU if small else FULL)[name] for name, value in given.items()}
    depths, batches, prompts = chosen["depths"], chosen["batches"], chosen["prompts"]
    # compile = auto compiles where a step shape compiles in seconds to a minute (accelerators), not on the CPU
    can_compile = settings.compile == "on" or (settings.compile == "auto" and not platforms.for_device(
        device).on_host_cores)
    kinds = [k.strip() for k in prompts.split(",") if k.strip()]
    if not kinds or set(kinds) - {"short", "long"}:
        raise UsageError(f"--prompts: expected short and/or long, got {prompts!r}")
    drafts = SPEC["drafts"]
    auto = "auto" in [d.strip() for d in depths.split(",")]
    depth_list = parse_list(",".join(d for d in depths.split(",") if d.strip() != "auto"), "--depths", drafts.lo,
                            drafts.hi, allow_empty=auto) + (["auto"] if auto else [])
    batch_list = parse_list(batches, "--batches", 1)
    temperature_list = parse_temperatures(temperatures)
    rule_list = [r.strip() for r in (rules or settings.verify).split(",") if r.strip()]
    if not rule_list or set(rule_list) - set(SPEC["verify"].choices):
        raise UsageError(f"--verify-rules: expected token and/or block, got {rules!r}")
    if 0 not in depth_list:
        depth_list = [0, *depth_list]        # speed-ups are against plain decoding in this run
    if not load_prompt:
        print(f"bench: {run_line(given, chosen, small, can_compile, settings.compile)}", file=sys.stderr)
    if sources["max_tokens"] == "default":
        settings = dataclasses.replace(settings, max_tokens=64)
    if load_prompt:
        return bench_command_under_load(settings, load_prompt, streams, as_json)
    engine = load_engine(settings, "bench", compile_in_background=False)
    if peer_model is None and settings.model is None:
        peer_model = str(BUNDLED_MODEL_DIR.with_name("dsv4-tiny-mtp"))
    peer = load_engine(dataclasses.replace(settings, model=peer_model), "bench", compile_in_background=False) \
        if peer_model and settings.tp == 1 else None
    # the compiled step against eager in the same run
    can_compile = can_compile and not platforms.for_device(engine.device).compile_unavailable_reason()
    compile_modes = (False, True) if can_compile else (False,)
    with torch.no_grad():
        # the peer needs the whole model; with --tp each process holds a slice
        sweep = Sweep(depth_list, batch_list, kinds, settings.max_tokens, compile_modes, tuple(temperature_list),
                      tuple(dict.fromkeys(rule_list)))
        rows = bench(engine, sweep, settings if not no_hf and settings.tp == 1 else None, peer)
    meta = {"model": str(settings.model_dir), "peer_model": peer_model, "device": str(engine.device),
            "dtype": engine.model_info.dtype,
            "threads": torch.get_num_threads(), "max_tokens": settings.max_tokens,
            "compile_cache": str(cache_dir()) if True in compile_modes else None}
    if as_json:
        print(json.dumps({"meta": meta, "results": rows}, indent=2))
    else:
        render(rows, table_console())
    return 0


def run_line(given: dict, chosen: dict, small: bool, compiled: bool, mode: str) -> str:
    """What the run will do, in one line: the defaults a small CPU gets, eager or compiled too."""
    defaults = " ".join(f"--{name} {chosen[name]}" for name, value in given.items() if value is None)
    cores = cpu_cores()
    parts = [f"{cores} CPU core{'s' if cores != 1 else ''}, so {defaults}" if small and defaults else ""]
    parts.append("the compiled step too (cold compiles take minutes per step shape)" if compiled else
                 "eager (compile = auto on the CPU; --compile on adds the compiled step, minutes per step shape)"
                 if mode == "auto" else "eager")
    return "; ".join(filter(None, parts))


def bench_command_under_load(settings, prompt_tokens: int, streams: int, as_json: bool) -> int:
    if prompt_tokens + settings.max_tokens + 1 >= settings.max_seq_len:
        raise UsageError(f"--under-load: {prompt_tokens} prompt tokens and {settings.max_tokens} steps don't fit "
                         f"max_seq_len {settings.max_seq_len}")
    engine = load_engine(settings, "bench", compile_in_background=False)
    with torch.no_grad():
        result = bench_under_load(engine, streams, prompt_tokens, settings.max_tokens)
    result.update(prefill_budget=settings.prefill_budget, compile=engine.status().compile is not None)
    meta = {"model": str(settings.model_dir), "device": str(engine.device), "threads": torch.get_num_threads()}
    if as_json:
        print(json.dumps({"meta": meta, "under_load": result}, indent=2))
    else:
        render_under_load(result, table_console())
    return 0
