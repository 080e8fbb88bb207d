"""lm-evaluation-harness's `local-completions` model end to end against a real `dsv4 serve` process on the bundled
model: a multiple-choice task and a rolling-loglikelihood (perplexity) task on local JSONL files, the remote
tokenizer found through /tokenizer_info, token-id prompts batched two to a request. Each loglikelihood the harness
reports is checked against a plain forward pass of the same model in this process, the prompt tokenised as the
harness does it."""
import json
import math
import re

import pytest
import torch
from test_serve import Server

from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.model import load_model
from dsv4cli.tokenizer import Tokenizer

TOL = 1e-3          # the served model is W8A8 (int8) and the engine prefills in chunks: not bit for bit
CAPITALS = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Japan", "Tokyo"), ("Germany", "Berlin")]
TEXTS = ["The capital of France is Paris.",
         "What is 3 plus 4? 3 + 4 = 7.",
         "The opposite of hot is cold. A cat says meow."]


def capital_docs() -> list[dict]:
    """Each question with four cities to choose from, the answer at a different place each time."""
    cities = [city for _, city in CAPITALS]
    docs = []
    for i, (country, city) in enumerate(CAPITALS):
        choices = [c for c in cities if c != city][:3]
        choices.insert(i % 4, city)
        docs.append({"question": f"What is the capital of {country}?", "lead": f"The capital of {country} is",
                     "choices": choices, "answer": i % 4})
    return docs


def write_task(directory, name: str, docs: list[dict], **config) -> None:
    """A task YAML (JSON is YAML) over a JSONL file of `docs`, read by the `json` dataset builder."""
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", **config, "metadata": {"version": 1.0}}
    (directory / f"{name}.yaml").write_text(json.dumps(task, indent=2))


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory):
    """`lm_eval.simple_evaluate` with `local-completions` on a greedy server, offline: its results, samples
    logged."""
    tasks = tmp_path_factory.mktemp("tasks")
    write_task(tasks, "dsv4_capitals", capital_docs(), output_type="multiple_choice",
               doc_to_text="{{question}} {{lead}}", doc_to_choice="choices", doc_to_target="answer",
               metric_list=[{"metric": "acc"}])
    write_task(tasks, "dsv4_texts", [{"text": t} for t in TEXTS], output_type="loglikelihood_rolling",
               doc_to_text="", doc_to_target="text",
               metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")])
    hf = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                            ("HF_HOME", str(hf)), ("HF_DATASETS_CACHE", str(hf / "datasets"))):
            mp.setenv(name, value)
        import datasets.config
        import lm_eval
        from lm_eval.tasks import TaskManager

        # datasets reads its environment once, at import: set it also where datasets looks, should another test
        # of this process have imported it first
        for name, value in (("HF_HUB_OFFLINE", True), ("HF_DATASETS_OFFLINE", True),
                            ("HF_DATASETS_CACHE", hf / "datasets")):
            mp.setattr(datasets.config, name, value)
        server = Server(tmp_path_factory.mktemp("serve"), "--temperature", "0")
        try:
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=f"base_url={server.url}/v1/completions,model=dsv4-tiny,tokenizer_backend=remote,"
                           f"num_concurrent=1,max_retries=1",
                tasks=["dsv4_capitals", "dsv4_texts"],
                task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                batch_size=2, log_samples=True, bootstrap_iters=0)
        finally:
            server.stop()
    assert results is not None, server.log.read_text()
    return results


@pytest.fixture(scope="module")
def reference():
    """(loglikelihood, greedy, decisive) of a continuation after a context, both token ids, from one forward pass
    of the bundled model here; `decisive`: every continuation token's logprob is more than 2 TOL from the best
    other token's, so greedy or not cannot flip between int8 kernels."""
    model = load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32)

    def score(context: list[int], continuation: list[int]) -> tuple[float, bool, bool]:
        ids = context + continuation
        with torch.inference_mode():
            lp = model.forward(torch.tensor([ids])).log_softmax(-1)[0]
        rows = lp[len(context) - 1:len(ids) - 1]           # row i scores token i + 1
        target = torch.tensor(continuation)
        chosen = rows.gather(-1, target[:, None])[:, 0]
        others = rows.scatter(-1, target[:, None], float("-inf")).max(-1).values
        gap = chosen - others
        return chosen.sum().item(), bool((gap >= 0).all()), bool((gap.abs() > 2 * TOL).all())

    return score


def encode_pair(tok: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm_eval's TemplateLM._encode_pair for a causal model: the context's trailing spaces move to the
    continuation; the whole text is encoded and split after the context's own tokens (no BOS: the remote
    tokenizer's /tokenize with add_special_tokens false)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = tok.encode(context + continuation), tok.encode(context)
    return head, whole[len(head):]


def test_multiple_choice_loglikelihoods_match_a_forward_pass(evaluation, reference):
    """Each choice's (loglikelihood, is_greedy) as the harness got them from /v1/completions (echo, logprobs 1,
    max_tokens 1, two token-id prompts a request) is the forward pass's; acc is their argmax against the answer."""
    tok, docs = Tokenizer.from_dir(BUNDLED_MODEL_DIR), capital_docs()
    samples = sorted(evaluation["samples"]["dsv4_capitals"], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == docs
    correct, worst = [], 0.0
    for sample, doc in zip(samples, docs):
        context = f"{doc['question']} {doc['lead']}"
        assert [tuple(a) for a in sample["arguments"]] == [(context, f" {c}") for c in doc["choices"]]
        assert [r[0] for r in sample["resps"]] == sample["filtered_resps"]
        for (ll, greedy), choice in zip(sample["filtered_resps"], doc["choices"]):
            want, want_greedy, decisive = reference(*encode_pair(tok, context, f" {choice}"))
            assert abs(ll - want) <= TOL, (context, choice, ll, want)
            worst = max(worst, abs(ll - want))
            assert greedy == want_greedy or not decisive, (context, choice, greedy)
        lls = [ll for ll, _ in sample["filtered_resps"]]
        correct.append(lls.index(max(lls)) == doc["answer"])
    acc = evaluation["results"]["dsv4_capitals"]["acc,none"]
    assert acc == pytest.approx(sum(correct) / len(docs))
    print(f"capitals: acc {acc}, max |loglikelihood - reference|: {worst:.2e}")


def test_rolling_loglikelihoods_match_a_forward_pass(evaluation, reference):
    """Each text's loglikelihood is its tokens' after the harness's prefix token (the remote tokenizer's BOS id, or
    EOS where that id is 0, as it is here), in one window; the perplexities follow from them."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    prefix = tok.bos_id or tok.eos_id           # lm_eval: `bos_token_id or eos_token_id`
    samples = sorted(evaluation["samples"]["dsv4_texts"], key=lambda s: s["doc_id"])
    assert [s["doc"]["text"] for s in samples] == TEXTS
    total, words, worst = 0.0, 0, 0.0
    for sample, text in zip(samples, TEXTS):
        assert sample["arguments"] == [(text,)] and sample["resps"] == [sample["filtered_resps"]]
        (ll,) = sample["filtered_resps"]
        want = reference([prefix], tok.encode(text))[0]
        assert abs(ll - want) <= TOL, (text, ll, want)
        worst = max(worst, abs(ll - want))
        total, words = total + want, words + len(re.split(r"\s+", text))
    metrics = evaluation["results"]["dsv4_texts"]
    assert all(math.isfinite(metrics[f"{m},none"]) for m in ("word_perplexity", "byte_perplexity", "bits_per_byte"))
    assert metrics["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-2)
    print(f"texts: word perplexity {metrics['word_perplexity,none']:.2f}, max |loglikelihood - reference|: {worst:.2e}")
