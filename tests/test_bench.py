"""`dsv4 bench` runs every configuration in one process and reports speed-ups against plain decoding."""
import json
import os
import subprocess
import sys


def test_bench_json(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "bench", "--model", str(tiny_model_dir), "--depths", "1,2",
                        "--batches", "1,2", "--prompts", "short", "--max-tokens", "6", "--json"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = out["results"]
    ours = [(x["batch"], x["drafts"]) for x in rows if x["impl"] == "dsv4"]
    assert ours == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]      # plain decoding added as the baseline
    assert all(x["tokens_per_s"] > 0 for x in rows)
    assert all(x["speedup"] == 1.0 for x in rows if x["impl"] == "dsv4" and x["drafts"] == 0)
    assert any(x["impl"] == "transformers" for x in rows)                  # the peer, on the same weights
    # long work shows progress: with stderr no terminal, a line as each configuration starts
    phases = [line for line in r.stderr.splitlines() if line.startswith("bench [")]
    assert [p.split("]")[0] for p in phases] == [f"bench [{i}/7" for i in range(1, 8)], r.stderr
    assert phases[0].endswith("plain K 0, batch 1, short prompt") and "transformers" in phases[3]


def test_bench_on_a_small_cpu_runs_a_set_that_ends_in_minutes_and_says_so(tiny_model_dir):
    """Unless told, a CPU of a few cores runs fewer configurations, eager (a cold compile takes minutes per step
    shape there), and the run says what it chose in one line."""
    env = {**os.environ, "DSV4_COMPILE": "auto"}
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "bench", "--model", str(tiny_model_dir), "--max-tokens", "4",
                        "--no-transformers", "--json"], capture_output=True, text=True, timeout=600, check=False,
                       env=env, preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == ("bench: 1 CPU core, so --depths 0,1,3,5,auto --batches 1,4 --prompts short; "
                                        "eager (compile = auto on the CPU; --compile on adds the compiled step, "
                                        "minutes per step shape)"), r.stderr
    rows = json.loads(r.stdout)["results"]
    assert [(x["batch"], x["drafts"], x["compile"]) for x in rows] == \
        [(b, k, False) for b in (1, 4) for k in (0, 1, 3, 5)]


def test_bench_bad_list_is_usage_error(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "bench", "--model", str(tiny_model_dir), "--depths", "a"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.startswith("error: --depths")


def test_bench_under_load_json(tiny_model_dir):
    """A prompt arriving while streams decode: its TTFT against the idle engine's, the streams' gaps."""
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "bench", "--model", str(tiny_model_dir), "--under-load", "40",
                        "--streams", "2", "--prefill-budget", "16", "--max-tokens", "3", "--json"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["under_load"]
    assert out["streams"] == 2 and out["prompt_tokens"] == 40 and out["prefill_budget"] == 16
    assert out["prefill_steps"] == 3                                  # 40 tokens at 16 a step
    assert out["ttft_s"] > 0 and out["idle_ttft_s"] > 0 and out["ttft_vs_idle"] == out["ttft_s"] / out["idle_ttft_s"]
    assert 0 < out["gap_median_ms"] <= out["gap_max_ms"]
