"""The bundled default model (dsv4cli/assets/dsv4-tiny, made by scripts/train_tiny.py).

No skips: a missing or broken asset fails here, since every CLI verb depends on it.
"""
import json

import pytest
import torch
from safetensors import safe_open

from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.encoding import encode_messages, parse_completion
from dsv4cli.engine import Engine, SamplingParams
from dsv4cli.model import load_model
from dsv4cli.model.quant import W8A8_DESCRIPTION
from dsv4cli.tokenizer import Tokenizer
from scripts.corpus import heldout_set, is_story, story_requests
from scripts.train_tiny import STORY_TOKENS

MAX_BYTES = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def model():
    return load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32)


@pytest.fixture(scope="module")
def config():
    return json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())


def test_files_and_size():
    files = {f.name for f in BUNDLED_MODEL_DIR.iterdir()}
    for name in ("config.json", W8A8_DESCRIPTION, "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "training.json"):
        assert name in files
    assert sum(f.stat().st_size for f in BUNDLED_MODEL_DIR.rglob("*") if f.is_file()) <= MAX_BYTES


def test_config_has_every_v4_feature(config):
    n = config["num_hidden_layers"]
    trunk = config["compress_ratios"][:n]
    assert {0, 4, 128} <= set(trunk)                          # window-only, CSA and HCA layers
    assert config["num_nextn_predict_layers"] == 1
    assert 0 < config["num_hash_layers"] < n                  # hash routing, then biased routing
    assert config["n_shared_experts"] == 1 and config["hc_mult"] > 1
    seq_len = json.loads((BUNDLED_MODEL_DIR / "training.json").read_text())["seq_len"]
    assert config["index_topk"] < seq_len // 4                # the indexer really selects
    assert config["sliding_window"] < seq_len


def test_w8a8_layout(model):
    description = json.loads((BUNDLED_MODEL_DIR / W8A8_DESCRIPTION).read_text())
    assert description["model_quant_type"] == "W8A8_DYNAMIC"
    int8 = [k for k, v in description.items() if v == "W8A8_DYNAMIC" and k.endswith(".weight")]
    assert "layers.0.attn.wq_a.weight" in int8 and "mtp.0.ffn.shared_experts.w2.weight" in int8
    shards = list(BUNDLED_MODEL_DIR.glob("quant_model_weights*.safetensors"))
    dtypes = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})  # noqa: SIM118 - not iterable
    assert all(dtypes[k] == "I8" for k in int8)
    assert model.layers[0].attn.wq_a.quantized and model.mtp[0].ffn.experts[0].w1.quantized


@torch.no_grad()
def test_greedy_answers_heldout_questions():
    """The held-out set of training.json (unseen operand pairs, unseen question phrasings and greetings),
    answered greedily through the engine with MTP: the accuracy it reports, and MTP acceptance."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    engine = Engine(load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32), tok, max_batch=8, max_seq_len=256, mtp=1)
    report = json.loads((BUNDLED_MODEL_DIR / "training.json").read_text())
    items = heldout_set(seed=report["heldout_seed"], n=report["heldout_items"])
    prompts = [tok.encode(encode_messages([{"role": "user", "content": it["question"]}])) for it in items]
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    right = [parse_completion(s.text, thinking=False)["content"].strip() == it["answer"] for s, it in zip(seqs, items)]
    facts = [r for r, it in zip(right, items) if it["kind"] not in ("add", "sub")]
    accuracy = sum(right) / len(right)
    print(f"held-out accuracy {accuracy:.3f}, facts and greetings {sum(facts) / len(facts):.3f}, "
          f"MTP acceptance {engine.totals.acceptance_rate:.3f}")
    # greedy with MTP == plain greedy, so this is training.json's number (up to a near-tie flipped by
    # another CPU's float rounding)
    assert abs(accuracy - report["w8a8"]["accuracy"]) <= 2 / len(items)
    assert accuracy >= 0.8
    assert sum(facts) >= 0.95 * len(facts)
    assert engine.totals.acceptance_rate >= 0.6


@torch.no_grad()
def test_raw_prompt_continues_a_story():
    """`generate --raw -p "Once upon a time"` tells a story like the corpus's (README)."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    engine = Engine(load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32), tok, max_batch=1, max_seq_len=256, mtp=1)
    opening = "Once upon a time"
    [seq] = engine.generate([[tok.bos_id, *tok.encode(opening)]], SamplingParams(temperature=0, max_tokens=96))
    story = opening + seq.text
    # The corpus's shortest story has 33 words; a finished one ends a sentence.
    assert story.startswith("Once upon a time, there was a ") and len(story.split()) >= 30
    assert seq.finish_reason == "stop" and story.endswith(".")


@torch.no_grad()
def test_story_requests_get_stories():
    """Chat-form story requests: the held-out phrasings behind training.json's story rate, answered
    greedily through the engine with MTP, and the README's examples."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    engine = Engine(load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32), tok, max_batch=8, max_seq_len=256, mtp=1)
    report = json.loads((BUNDLED_MODEL_DIR / "training.json").read_text())["stories"]["w8a8"]
    requests = story_requests("heldout")
    readme = ["Tell me a story.", "Can you tell me a short story?"]
    prompts = [tok.encode(encode_messages([{"role": "user", "content": r}])) for r in requests + readme]
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=STORY_TOKENS))
    stories = [is_story(parse_completion(s.text, thinking=False)["content"].strip()) for s in seqs]
    rate = sum(stories[: len(requests)]) / len(requests)
    print(f"held-out story rate {rate:.2f}")
    assert abs(rate - report["story_rate"]) <= 1 / len(requests)
    assert rate >= 0.9
    assert all(stories[len(requests):])
