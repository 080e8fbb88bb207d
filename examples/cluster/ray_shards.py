"""One batch input answered by a Ray task per shard, then merged; Ray schedules the tasks on the cluster's nodes
and reruns a task whose node dies (its shard resumes: --resume answers only what its files do not hold yet).

    python examples/cluster/ray_shards.py requests.jsonl results.jsonl --shards 4 [--gpus-per-shard 1] \
        [-- more dsv4 batch flags, e.g. --model /models/DeepSeek-V4-Flash --temperature 0]

Every node needs dsv4cli installed in the Python that runs Ray's workers, and the input and results on a file
system they all see. Ray is not a dependency of dsv4cli: `pip install ray` where you run this. Tried with Ray
2.60.0 on a local cluster (`ray.init()` with no address: this machine); `RAY_ADDRESS` joins a running one.
"""
import argparse
import subprocess
import sys

import ray


@ray.remote(max_retries=3, retry_exceptions=True)
def shard(index: int, count: int, src: str, out: str, flags: list[str]) -> str:
    """One shard in a process of its own, as `dsv4 batch` runs it from a shell; its summary line."""
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "batch", src, "-o", out, "--shard", f"{index}/{count}",
                        "--resume", *flags], capture_output=True, text=True)
    if r.returncode:        # raised: Ray runs the task again, and the shard resumes
        raise RuntimeError(f"shard {index}/{count}: {r.stderr.strip()}")
    return r.stderr.strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--cpus-per-shard", type=float, default=1)
    p.add_argument("--gpus-per-shard", type=float, default=0)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)     # what follows -- goes to dsv4 batch
    args, flags = p.parse_args(argv[:cut]), argv[cut + 1:]
    ray.init()
    task = shard.options(num_cpus=args.cpus_per_shard, num_gpus=args.gpus_per_shard)
    runs = [task.remote(i, args.shards, args.input, args.output, flags) for i in range(args.shards)]
    for line in ray.get(runs):
        print(line, file=sys.stderr)
    merged = subprocess.run([sys.executable, "-m", "dsv4cli", "batch", "merge", args.output, "--retry-failed",
                             *flags])
    sys.exit(merged.returncode)


if __name__ == "__main__":
    main()
