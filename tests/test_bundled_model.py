"""The bundled models: dsv4cli/assets/dsv4-tiny-mtp, the preview layout with its MTP layer
(scripts/train_tiny.py), and the default dsv4cli/assets/dsv4-tiny, the 0731 layout: the same trunk with a
DSpark drafter (scripts/train_dspark.py).

No skips: a missing or broken asset fails here, since every CLI verb depends on it.
"""
import json

import pytest
import torch
from safetensors import safe_open

from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.encoding import encode_messages, parse_completion
from dsv4cli.engine import Engine, EngineOptions, SamplingParams
from dsv4cli.model import load_model
from dsv4cli.model.quant import W8A8_DESCRIPTION
from dsv4cli.tokenizer import Tokenizer
from scripts.corpus import heldout_set, is_story, story_requests
from scripts.train_dspark import acceptance
from scripts.train_tiny import STORY_TOKENS

MAX_BYTES = 20 * 1024 * 1024          # both, together: they ship in the wheel
PREVIEW_DIR = BUNDLED_MODEL_DIR.parent / "dsv4-tiny-mtp"
MODELS = pytest.mark.parametrize("model_dir", [BUNDLED_MODEL_DIR, PREVIEW_DIR], ids=["0731", "preview"])


def config_of(model_dir):
    return json.loads((model_dir / "config.json").read_text())


@MODELS
def test_files_and_size(model_dir):
    files = {f.name for f in model_dir.iterdir()}
    for name in ("config.json", W8A8_DESCRIPTION, "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "training.json"):
        assert name in files
    assets = BUNDLED_MODEL_DIR.parent
    assert sum(f.stat().st_size for f in assets.rglob("*") if f.is_file()) <= MAX_BYTES


@MODELS
def test_config_has_every_v4_feature(model_dir):
    config = config_of(model_dir)
    n = config["num_hidden_layers"]
    trunk = config["compress_ratios"][:n]
    assert {0, 4, 128} <= set(trunk)                          # window-only, CSA and HCA layers
    assert config["num_nextn_predict_layers"] == 1            # 0731 keeps the legacy field at 1
    assert 0 < config["num_hash_layers"] < n                  # hash routing, then biased routing
    assert config["n_shared_experts"] == 1 and config["hc_mult"] > 1
    seq_len = json.loads((model_dir / "training.json").read_text())["seq_len"]
    assert config["index_topk"] < seq_len // 4                # the indexer really selects
    assert config["sliding_window"] < seq_len


def test_the_default_model_is_0731s_layout():
    """Its trunk is the preview model's, tensor for tensor; past it, three DSpark stages (window-only) with
    0731's block of 5, the noise token <｜System｜>, the last three layers as targets."""
    config, preview = config_of(BUNDLED_MODEL_DIR), config_of(PREVIEW_DIR)
    n = config["num_hidden_layers"]
    assert config["compress_ratios"] == preview["compress_ratios"][:n] + [0, 0, 0]
    assert config["dspark_block_size"] == 5 and config["dspark_target_layer_ids"] == [n - 3, n - 2, n - 1]
    assert config["dspark_noise_token_id"] == Tokenizer.from_dir(BUNDLED_MODEL_DIR).special_ids["<｜System｜>"]
    assert "dspark_block_size" not in preview
    trunk, mtp = load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32), load_model(PREVIEW_DIR, "cpu", torch.float32)
    assert trunk.cfg.drafter == "dspark" and mtp.cfg.drafter == "mtp"
    theirs = mtp.state_dict()
    for name, t in trunk.state_dict().items():
        if not name.startswith("mtp."):
            torch.testing.assert_close(t, theirs[name], rtol=0, atol=0, msg=name)


def tensor_dtypes(model_dir) -> dict[str, str]:
    dtypes = {}
    for shard in model_dir.glob("quant_model_weights*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})  # noqa: SIM118 - not iterable
    return dtypes


@MODELS
def test_w8a8_layout(model_dir):
    description = json.loads((model_dir / W8A8_DESCRIPTION).read_text())
    assert description["model_quant_type"] == "W8A8_DYNAMIC"
    int8 = [k for k, v in description.items() if v == "W8A8_DYNAMIC" and k.endswith(".weight")]
    assert "layers.0.attn.wq_a.weight" in int8 and "mtp.0.ffn.shared_experts.w2.weight" in int8
    dtypes = tensor_dtypes(model_dir)
    assert all(dtypes[k] == "I8" for k in int8)
    model = load_model(model_dir, "cpu", torch.float32)
    assert model.layers[0].attn.wq_a.quantized and model.mtp[0].ffn.experts[0].w1.quantized
    if model_dir == BUNDLED_MODEL_DIR:        # msModelSlim's 0731 recipe, and the drafter's own vocabulary
        assert {"mtp.0.main_proj.weight", "mtp.2.attn.wo_a.weight"} <= set(int8)
        assert dtypes["mtp.0.embed.weight"] == dtypes["mtp.2.head.weight"] == "BF16"
        assert dtypes["mtp.2.markov_head.markov_w2.weight"] == "BF16"
        assert model.cfg.dspark_vocab_copies


def heldout(model_dir, mtp):
    """Greedy replies to training.json's held-out set (unseen operand pairs, question phrasings, greetings)
    through the engine at `mtp`: (the items, whether each was right, the engine's totals)."""
    tok = Tokenizer.from_dir(model_dir)
    engine = Engine(load_model(model_dir, "cpu", torch.float32), tok,
                    EngineOptions(max_batch=8, max_seq_len=256, drafts=mtp))
    report = json.loads((model_dir / "training.json").read_text())
    items = heldout_set(seed=report["heldout_seed"], n=report["heldout_items"])
    prompts = [tok.encode(encode_messages([{"role": "user", "content": it["question"]}], encoding=tok.encoding))
               for it in items]
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    right = [parse_completion(s.text, thinking=False)["content"].strip() == it["answer"] for s, it in zip(seqs, items)]
    return items, right, engine.totals, report


@MODELS
@torch.no_grad()
def test_greedy_answers_heldout_questions(model_dir):
    """The accuracy training.json reports, through the engine with the model's drafter (the MTP layer, or
    DSpark's block with the verified length chosen per step)."""
    items, right, totals, report = heldout(model_dir, "auto")
    facts = [r for r, it in zip(right, items) if it["kind"] not in ("add", "sub")]
    accuracy = sum(right) / len(right)
    print(f"held-out accuracy {accuracy:.3f}, facts and greetings {sum(facts) / len(facts):.3f}, "
          f"acceptance {totals.acceptance_rate:.3f}, mean acceptance length {totals.mean_acceptance_length:.2f}")
    # greedy with a drafter == plain greedy, so this is training.json's number (up to a near-tie flipped by
    # another CPU's float rounding)
    assert abs(accuracy - report["w8a8"]["accuracy"]) <= 2 / len(items)
    assert accuracy >= 0.8
    assert sum(facts) >= 0.95 * len(facts)
    assert totals.acceptance_rate >= 0.6


@torch.no_grad()
def test_dspark_drafts_most_of_each_reply():
    """training.json's evaluation again (the held-out replies, the whole block verified, greedy output equal
    to plain greedy): DSpark's mean acceptance length as reported, at least 3 tokens a step."""
    report = json.loads((BUNDLED_MODEL_DIR / "training.json").read_text())["dspark"]
    got = acceptance(load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32), Tokenizer.from_dir(BUNDLED_MODEL_DIR),
                     heldout_set(report["heldout_seed"], report["heldout_items"]))
    print(got)
    assert got["mean_acceptance_length"] >= 3.0
    assert abs(got["mean_acceptance_length"] - report["w8a8"]["mean_acceptance_length"]) <= 0.1


@torch.no_grad()
def test_raw_prompt_continues_a_story():
    """`generate --raw -p "Once upon a time"` tells a story like the corpus's (README)."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    engine = Engine(load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32), tok,
                    EngineOptions(max_batch=1, max_seq_len=256, drafts="auto"))
    opening = "Once upon a time"
    [seq] = engine.generate([[tok.bos_id, *tok.encode(opening)]], SamplingParams(temperature=0, max_tokens=96))
    story = opening + seq.text
    # The corpus's shortest story has 33 words; a finished one ends a sentence.
    assert story.startswith("Once upon a time, there was a ") and len(story.split()) >= 30
    assert seq.finish_reason == "stop" and story.endswith(".")


@torch.no_grad()
def test_story_requests_get_stories():
    """Chat-form story requests: the held-out phrasings behind training.json's story rate, answered
    greedily through the engine with DSpark, and the README's examples."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    engine = Engine(load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32), tok,
                    EngineOptions(max_batch=8, max_seq_len=256, drafts="auto"))
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
