import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4cli.encoding import encode_messages
from dsv4cli.tokenizer import SPECIAL_TOKENS, StreamDecoder, Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `scripts.*`
from scripts.corpus import build_corpus
from scripts.train_tokenizer import train_tokenizer

# Repeated multi-byte text makes BPE learn merges that cross character boundaries.
MULTILINGUAL = ["你好世界，我爱北京。", "naïve café ünïcödé", "🙂🎉👍 emoji 🙂🎉", "日本語のテキスト"]
SAMPLES = [
    "你好世界，我爱北京。深度求索 🙂 ok",
    "naïve café, 🎉👍🏽 and 日本語のテキスト!",
    "The capital of France is Paris. " * 20,
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(build_corpus(seed=0, n_chat=400, n_text=100) + MULTILINGUAL * 50, out, vocab_size=600)
    return out


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return Tokenizer.from_dir(tokenizer_dir)


def test_digits_are_single_tokens(tok):
    """Numbers are spelt digit by digit (sums of unseen operands share the seen digit patterns)."""
    text = "What is 18 + 217? 18 + 217 = 235."
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert "".join(pieces) == text
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("1821718217235")


def test_special_tokens_are_single_ids(tok):
    assert (tok.bos_id, tok.eos_id, tok.special_ids["<｜▁pad▁｜>"]) == (0, 1, 2)
    assert set(tok.special_ids) == set(SPECIAL_TOKENS)
    for token, token_id in tok.special_ids.items():
        assert tok.encode(token) == [token_id]
        assert tok.decode([token_id]) == token
    assert tok.vocab_size == 600


def test_config_files(tokenizer_dir):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    assert config["bos_token"] == "<｜begin▁of▁sentence｜>"
    assert config["eos_token"] == config["pad_token"] == "<｜end▁of▁sentence｜>"
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_encode_adds_no_bos_and_round_trips(tok):
    assert tok.bos_id not in tok.encode("Hello there")
    prompt = encode_messages([{"role": "user", "content": "What is 2 + 3?"}])
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[-2:] == [tok.special_ids["<｜Assistant｜>"], tok.special_ids["</think>"]]
    for text in SAMPLES + [prompt]:
        assert tok.decode(tok.encode(text)) == text


def test_loads_with_transformers(tokenizer_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    prompt = encode_messages([{"role": "user", "content": "你好 🙂"}])
    assert hf.encode(prompt, add_special_tokens=False) == tok.encode(prompt)
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_id, tok.eos_id)


def test_missing_or_broken_tokenizer_file(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_config_with_added_token_dicts(tokenizer_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    config = {"bos_token": {"content": "<｜User｜>"}, "eos_token": {"content": "<｜Assistant｜>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (tok.special_ids["<｜User｜>"], tok.special_ids["<｜Assistant｜>"])


def test_stream_decoder_never_splits_characters(tok):
    encoded = [tok.encode(text) for text in SAMPLES]
    assert any("\ufffd" in tok.decode([i]) for ids in encoded for i in ids), "no token splits a character"
    for text, ids in zip(SAMPLES, encoded):
        stream = StreamDecoder(tok)
        chunks = [stream.push(i) for i in ids] + [stream.flush()]
        assert not any("\ufffd" in chunk for chunk in chunks)
        assert "".join(chunks) == tok.decode(ids) == text


def test_stream_decoder_window_stays_small(tok):
    stream = StreamDecoder(tok)
    ids = tok.encode("Once upon a time, there was a little cat named Tom. 你好。" * 30)
    longest = 0
    for i in ids:
        stream.push(i)
        longest = max(longest, len(stream._ids))
    assert longest <= 16
    # Raw bytes that never complete a character still come out on flush.
    stream.flush()
    lead_byte = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")
    assert stream.push(lead_byte) == ""
    assert stream.flush() == "\ufffd"


def test_train_tokenizer_script(tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_tokenizer.py"
    subprocess.run([sys.executable, str(script), str(tmp_path), "512"], check=True, capture_output=True)
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 512)


def test_visible_text_has_no_special_tokens_and_streams_as_a_prefix(tok):
    """What readers see (skip_special_tokens); every prefix shown while a reply streams begins the final text."""
    raw = "2 + 3 = 5.<｜end▁of▁sentence｜><｜begin▁of▁sentence｜><｜User｜>Is 1 < 2?<｜Assistant｜></think>Yes"
    final = tok.visible(raw)
    assert final == "2 + 3 = 5.Is 1 < 2?Yes" and final == tok._tok.decode(tok.encode(raw), skip_special_tokens=True)
    assert all(final.startswith(tok.visible(raw[:n], final=False)) for n in range(len(raw) + 1))
    assert tok.visible("Is 1 <", final=False) == "Is 1 " and tok.visible("Is 1 <") == "Is 1 <"
