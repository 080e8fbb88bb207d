"""No special token (chat markers, `</think>`, EOS) in the text a user sees: generate, chat, batch and the
streamed chunks of serve, with the bundled model, which writes them once it runs past its end (--ignore-eos)."""
import json
import os
import subprocess
import sys

import torch

from dsv4cli.config import BUNDLED_MODEL_DIR, resolve
from dsv4cli.loading import load_engine, sampling_params
from dsv4cli.openai.requests import BodyParser
from dsv4cli.openai.responses import ChunkStream, completion
from dsv4cli.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
SPECIALS = [t.content for t in TOK._tok.get_added_tokens_decoder().values() if t.special]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PAST_THE_END = ("--temperature", "0", "-n", "40", "--ignore-eos")   # "2 + 3 = 5.<｜end▁of▁sentence｜>...<｜User｜>..."


def dsv4(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dsv4cli", *args], capture_output=True, text=True, timeout=300,
                          **{"env": ENV, **kw})


def clean(text: str) -> bool:
    return not any(t in text for t in SPECIALS)


def test_generate_shows_no_special_tokens_and_json_keeps_the_ids():
    args = ("generate", "-p", "What is 2 plus 3?", *PAST_THE_END)
    r = dsv4(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("2 + 3 = 5.") and clean(r.stdout), r.stdout
    result = json.loads(dsv4(*args, "--json").stdout)
    assert result["text"] == r.stdout.removesuffix("\n")
    assert TOK.eos_id in result["token_ids"] and not clean(TOK.decode(result["token_ids"]))
    r = dsv4("generate", "-p", "Hi", "--thinking", *PAST_THE_END, "--json")
    result = json.loads(r.stdout)
    assert result["reasoning_content"] and clean(result["reasoning_content"]) and clean(result["text"]), result


def test_chat_shows_and_keeps_no_special_tokens(tmp_path):
    path = tmp_path / "chat.json"
    r = dsv4("chat", *PAST_THE_END, input=f"What is 2 plus 3?\nHi\n/save {path}\n",
             env={**ENV, "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("2 + 3 = 5.") and clean(r.stdout), r.stdout
    replies = [m["content"] for m in json.loads(path.read_text())["messages"] if m["role"] == "assistant"]
    assert len(replies) == 2 and all(replies) and all(map(clean, replies)), replies


def test_batch_results_show_no_special_tokens(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "chat", "messages": [{"role": "user", "content": "What is 2 plus 3?"}]}) + "\n"
                   + json.dumps({"id": "think", "messages": [{"role": "user", "content": "Hi"}], "thinking": True})
                   + "\n" + json.dumps({"id": "text", "prompt": "<｜User｜>What is 2 plus 3?<｜Assistant｜></think>"})
                   + "\n")
    r = dsv4("batch", str(src), "-o", str(out), *PAST_THE_END)
    assert r.returncode == 0, r.stderr
    choices = {rec["custom_id"]: rec["response"]["body"]["choices"][0] for rec in map(json.loads, out.open())}
    shown = [choices["chat"]["message"]["content"], *choices["think"]["message"].values(), choices["text"]["text"]]
    assert all(map(clean, shown)), shown
    assert choices["text"]["text"].startswith("2 + 3 = 5.What is")      # a completion goes on past the EOS


@torch.no_grad()
def test_streamed_chunks_add_up_to_the_message_without_special_tokens():
    """serve's chunks (the bodies dsv4 serve sends, built by the same ChunkStream), token by token."""
    s, _ = resolve(None, {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, "drafts": 0}, env={})
    engine = load_engine(s, "serve", compile_in_background=False)
    parser = BodyParser(engine.tok, sampling_params(s), engine.max_seq_len)
    bodies = [({"messages": [{"role": "user", "content": "What is 2 plus 3?"}]}, True),
              ({"messages": [{"role": "user", "content": "Hi"}], "thinking": True}, True),
              ({"prompt": "<｜User｜>What is 2 plus 3?<｜Assistant｜></think>"}, False)]
    for body, chat in bodies:
        req = parser.parse(body | {"stream": True}, chat, server=True)
        seq = engine.submit(req.prompt_ids, req.params)
        stream = ChunkStream(req, engine.tok, "dsv4-tiny", "1")
        chunks = stream.first()
        while engine.has_work():
            for event in engine.step():
                chunks += stream.update(event.text, [])
        chunks += stream.finish(seq)
        whole = completion(req, seq, "dsv4-tiny", engine.tok, "1")["choices"][0]
        if chat:
            for field in ("content", "reasoning_content"):
                streamed = "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks)
                assert streamed == (whole["message"].get(field) or "") and clean(streamed), (field, streamed)
        else:
            streamed = "".join(c["choices"][0]["text"] for c in chunks)
            assert streamed == whole["text"] and clean(streamed) and TOK.eos_id in seq.output_ids, streamed
