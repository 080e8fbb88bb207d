"""`dsv4 generate`: one prompt, streamed to stdout (or one JSON object)."""
import json
import sys

from dsv4cli.cli import CliOptions, app, model_options, register_mode
from dsv4cli.config import Settings
from dsv4cli.encoding import encode_messages
from dsv4cli.errors import UsageError
from dsv4cli.session import load_engine, sampling_params


def prompt_ids(engine, s: Settings) -> list[int]:
    """Chat-encode the prompt (system + one user turn), or BOS + the text as is with --raw."""
    if s.prompt is None:
        raise UsageError("--prompt: missing; give the text to complete")
    tok = engine.tok
    if s.raw:
        return [tok.bos_id, *tok.encode(s.prompt)]
    messages = ([{"role": "system", "content": s.system}] if s.system else []) + [{"role": "user", "content": s.prompt}]
    text = encode_messages(messages, thinking=s.thinking, reasoning_effort=s.reasoning_effort)
    return tok.encode(text)


def run_generate(s: Settings) -> int:
    engine = load_engine(s)
    ids = prompt_ids(engine, s)
    try:
        seq = engine.submit(ids, sampling_params(s))
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        while engine.has_work():
            for event in engine.step():
                if not s.json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        engine.cancel(seq)
    if s.json:
        print(json.dumps({"text": seq.text, "token_ids": seq.output_ids, "finish_reason": seq.finish_reason,
                          "stats": seq.metrics.as_dict()}))
    else:
        sys.stdout.write("\n")
    return 130 if seq.finish_reason == "cancelled" else 0


@app.command()
@model_options("prompt", "raw", "json", "system", "thinking", "reasoning_effort")
def generate(opts: CliOptions) -> int:
    """Generate a reply to one prompt with the model (the bundled one by default)."""
    settings, _ = opts.resolve()
    return run_generate(settings)


register_mode("generate", run_generate)
