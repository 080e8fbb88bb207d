"""Every drafter kind has every part, and they agree: its description (`model/drafters.py`), its stage module
(`model.STAGES`), its proposer (`engine.runner.PROPOSERS`), a tiny config that has it (`tiny.TINY_DRAFTERS`) and
tests of its own (`tests/test_<name>.py`); greedy output with its drafts is plain greedy output, a resumed chat
turn's a fresh one's, and its proposals carry what its description says. An unknown kind is an error, not
another kind. The recipe for a new kind: docs/architecture.md, "A drafter kind"."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from test_startup import module_tensors
from tiny import TINY_DRAFTERS, prompts, random_model, tiny_config

from dsv4cli.engine import Engine, EngineOptions, SamplingParams
from dsv4cli.engine.runner import PROPOSERS, make_drafter
from dsv4cli.model import ModelConfig, drafters
from dsv4cli.model.drafters import DRAFTERS, MTP, DrafterKind, drafter_kind, drafter_named
from dsv4cli.model.footprint import model_tensors
from dsv4cli.model.model import STAGES
from dsv4cli.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
KINDS = list(DRAFTERS.values())
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(ROOT / "dsv4cli/assets/dsv4-tiny")      # any tokenizer: the tests read token ids


def model_of(kind: DrafterKind):
    return random_model(TINY_DRAFTERS[kind.name](), seed=5)


def test_the_registries_name_the_same_kinds():
    assert set(STAGES) == set(PROPOSERS) == set(KINDS) and set(TINY_DRAFTERS) == set(DRAFTERS)


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_every_kind_has_every_part(kind):
    for field in dataclasses.fields(DrafterKind):       # every field given, of its type
        value = getattr(kind, field.name)
        if field.type == "str":
            assert isinstance(value, str) and value, field.name
        elif field.type == "bool":
            assert isinstance(value, bool), field.name
        elif field.type.startswith("Callable"):
            assert callable(value), field.name
        else:
            assert value is None or isinstance(value, re.Pattern), field.name
    assert DRAFTERS[kind.name] is kind and drafter_named(kind.name) is kind
    assert kind in STAGES and kind in PROPOSERS
    assert (ROOT / "tests" / f"test_{kind.name}.py").exists(), "its own tests"
    cfg = ModelConfig.from_dict(TINY_DRAFTERS[kind.name]())
    assert drafter_kind(cfg) is kind and cfg.drafter == kind.name


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_the_description_is_what_the_modules_do(kind, tok):
    """The stages are its stage module, the footprint's arithmetic lists what they hold, the trunk gives target
    features where it has target layers, and its sampled proposals carry q, and confidences as it says."""
    model = model_of(kind)
    cfg = model.cfg
    assert all(type(stage) is STAGES[kind] for stage in model.mtp) and len(model.mtp) == cfg.n_mtp_layers
    assert {t.name: t for t in model_tensors(cfg)} == {t.name: t for t in module_tensors(model)}
    most = kind.max_depth(cfg)
    assert kind.auto_depth(cfg) >= 1 and (most is None or most >= kind.auto_depth(cfg)) and kind.write_ahead(2) >= 0
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=128, drafts=2))
    assert type(eng.runner.drafter) is PROPOSERS[kind] and eng.runner.drafter.depth == 2
    propose, proposals = eng.runner.drafter.propose, []

    def recorded(rows, mode):
        assert all((r.features is not None) == bool(kind.target_layers(cfg)) for r in rows)
        made = propose(rows, mode)
        proposals.extend(made)
        return made

    eng.runner.drafter.propose = recorded
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    assert all(s.finish_reason == "length" for s in eng.generate(prompts([5, 9], cfg.vocab_size), sampled))
    assert proposals
    for p in proposals:
        assert p.drafts.shape[1] == 2
        assert p.q is not None and (p.confidence is not None) == kind.confidence


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
@torch.no_grad()
def test_greedy_with_each_kinds_drafts_is_plain_greedy(kind, tok):
    """At depth 1, 2 and auto, batch 1 and 3; a chat turn resumed in its slot (what the drafter wrote ahead of
    the committed tokens is not trusted) replies as a fresh engine does."""
    model = model_of(kind)
    ps = prompts([3, 17, 40], model.cfg.vocab_size)
    plain = [s.output_ids for s in Engine(model, tok, EngineOptions(max_batch=3, max_seq_len=256, drafts=0))
             .generate(ps, GREEDY)]
    for depth in (1, 2, "auto"):
        for batch in (1, 3):
            eng = Engine(model, tok, EngineOptions(max_batch=batch, max_seq_len=256, drafts=depth))
            assert [s.output_ids for s in eng.generate(ps, GREEDY)] == plain, (depth, batch)
            assert eng.totals.draft_tokens > 0
    chat = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=2, reuse_prefix=True))
    fresh = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=2))
    conversation = ps[2]
    for user in prompts([9, 4], model.cfg.vocab_size, seed=2):
        seq = chat.generate([conversation], GREEDY)[0]
        assert seq.output_ids == fresh.generate([conversation], GREEDY)[0].output_ids
        conversation = conversation + seq.output_ids + user
    assert chat.generate([conversation], GREEDY)[0].metrics.cached_tokens > 0


def test_an_unknown_kind_is_an_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown drafter kind 'eagle' \\(known: dspark, mtp\\)"):
        drafter_named("eagle")
    assert drafter_named(None) is None
    plain = tiny_config(num_nextn_predict_layers=0, compress_ratios=[0, 4, 128, 4])
    assert drafter_kind(ModelConfig.from_dict(plain)) is None
    # a kind with a description but no proposer gets none, not another kind's
    model = random_model(tiny_config())
    monkeypatch.setattr(drafters, "DRAFTERS", {"other": dataclasses.replace(MTP, name="other")})
    with pytest.raises(KeyError):
        make_drafter(model, 1)


def test_outside_the_model_mtp_names_only_the_mtp_chain_or_a_checkpoint_name():
    """Engine, CLI and front-end code say draft/drafter for any drafter; an identifier with "mtp" in it is the
    preview's MTP chain (`MTP`, `MTPDrafter`, `engine/mtp.py`, the model's `mtp_*` calls) or a checkpoint name
    (`model.mtp`, the `mtp.N` module list; `n_mtp_layers`, the config key). Strings (the `--mtp` alias, the kind's
    name "mtp") are not identifiers."""
    import tokenize

    chain = {"MTP", "MTPDrafter", "mtp_forward_segments", "mtp_logits", "n_mtp_layers"}
    found = []
    for path in sorted((ROOT / "dsv4cli").rglob("*.py")):
        if path.parent.name == "model":
            continue
        with open(path, "rb") as f:
            tokens = [t for t in tokenize.tokenize(f.readline) if t.type == tokenize.NAME or t.string == "."]
        for i, t in enumerate(tokens):
            if "mtp" not in t.string.lower() or t.string in chain:
                continue
            if t.string == "mtp" and i >= 2 and tokens[i - 2].string in ("model", "from"):   # model.mtp; from .mtp
                continue
            found.append(f"{path.relative_to(ROOT)}:{t.start[0]}: {t.string}")
    assert not found
