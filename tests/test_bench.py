"""`dsv4 bench` runs every configuration in one process and reports speed-ups against plain decoding."""
import json
import subprocess
import sys


def test_bench_json(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "bench", "--model", str(tiny_model_dir), "--depths", "1,2",
                        "--batches", "1,2", "--prompts", "short", "--max-tokens", "6", "--json"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = out["results"]
    ours = [(x["batch"], x["mtp"]) for x in rows if x["impl"] == "dsv4"]
    assert ours == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]      # plain decoding added as the baseline
    assert all(x["tokens_per_s"] > 0 for x in rows)
    assert all(x["speedup"] == 1.0 for x in rows if x["impl"] == "dsv4" and x["mtp"] == 0)
    assert any(x["impl"] == "transformers" for x in rows)                  # the peer, on the same weights
    # long work shows progress: with stderr no terminal, a line as each configuration starts
    phases = [line for line in r.stderr.splitlines() if line.startswith("bench [")]
    assert [p.split("]")[0] for p in phases] == [f"bench [{i}/7" for i in range(1, 8)], r.stderr
    assert phases[0].endswith("plain K 0, batch 1, short prompt") and "transformers" in phases[3]


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
