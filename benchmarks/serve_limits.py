"""`dsv4 serve` under abuse: large bodies, idle connections, SIGTERM with streams open (issue 35's targets).

    python benchmarks/serve_limits.py [--out benchmarks/results/serve-limits-cpu.json]

1. Four completions stream (4000 tokens each) while another process, at nice 19 (as a client on another
   machine would not take this one's cores), sends: nothing (control), 50 MB to a plain socket that
   drops it (control: what moving 50 MB over loopback costs here), then to the server the head of a 50 MB
   request alone (the time to the 413 itself), a 50 MB body with a Content-Length, 50 MB chunked, a 7 MB
   prompt under the body limit, a valid 7 MB body (metadata), a 100k-deep JSON text. For each: the status
   and time of the answer, /health's worst latency meanwhile (polled every 20 ms) and the streams' worst
   gap between tokens meanwhile, against their median before. On a shared machine compare each case with
   the controls. Targets: 413 in < 1 s, /health < 100 ms, no gap over 2x the median.
2. 2,000 connections that never send a whole request to a server allowed 1,024 open files: /health's
   latency over 100 requests (target < 100 ms) and the size of the server's log.
3. SIGTERM with 8 streams open (4 short enough to finish within --shutdown-timeout 10, 4 not): how each
   ended ([DONE] or an error event), the exit code and how long the server took to exit (target: exit 0).
"""
import argparse
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DSV4_COMPILE": "off"}
SENDER = r'''
import json, socket, sys, threading, time
import httpx2 as httpx
url = sys.argv[1]
sink = socket.socket(); sink.bind(("127.0.0.1", 0)); sink.listen()
def drop():
    while True:
        c, _ = sink.accept()
        while (data := c.recv(1 << 20)) and not data.endswith(b"}]}"):
            pass
        c.sendall(b"HTTP/1.1 413 X\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}"); c.close()
threading.Thread(target=drop, daemon=True).start()
big = b'{"messages": [{"role": "user", "content": "' + b"x" * (50 << 20) + b'"}]}'
prompt = b'{"messages": [{"role": "user", "content": "' + b"What is the capital of France? " * (7 << 15) + b'"}]}'
meta = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                   "metadata": {f"k{i}": "v" * 100 for i in range(70000)}}).encode()
drops = f"http://127.0.0.1:{sink.getsockname()[1]}"
cases = [("nothing (control)", None, None), ("50 MB to a socket that drops it (control)", drops, big),
         ("50 MB announced, head sent alone", url, "head"), ("50 MB, Content-Length", url, big),
         ("50 MB, chunked", url, "chunked"),
         (f"{len(prompt) >> 20} MB prompt under the body limit", url, prompt),
         (f"{len(meta) >> 20} MB valid body", url, meta), ("100k-deep JSON", url, b"[" * 100000 + b"]" * 100000)]
for name, to, body in cases:
    time.sleep(1)
    t0, wall = time.perf_counter(), time.time()
    if to is None:
        time.sleep(0.3); status = 0
    elif body == "head":                    # the time to the answer alone, without sending 50 MB first
        host, port = to.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(big)}\r\n\r\n".encode())
            status = int(s.recv(100).split()[1])
    else:
        content = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)) if body == "chunked" else body
        status = httpx.post(to + "/v1/chat/completions", content=content, headers={"content-type": "application/json"},
                            timeout=60).status_code
    print(json.dumps({"case": name, "status": status, "ms": (time.perf_counter() - t0) * 1000, "from": wall,
                      "to": time.time()}), flush=True)
'''


def start(*args: str, open_files: int | None = None) -> tuple[subprocess.Popen, str]:
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))) if open_files else None
    proc = subprocess.Popen([sys.executable, "-m", "dsv4cli", "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=limit, cwd=ROOT)
    return proc, re.search(r"(http://\S+)/v1", proc.stdout.readline())[1]


def stream(url: str, max_tokens: int, lines: list, stop: threading.Event | None = None) -> None:
    """A streamed completion; each data line with its arrival time."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append((time.time(), line))
            if stop is not None and stop.is_set():
                return


def large_bodies() -> list[dict]:
    proc, url = start()
    stop, health = threading.Event(), []
    streams = [[] for _ in range(4)]
    threads = [threading.Thread(target=stream, args=(url, 4000, lines, stop)) for lines in streams]

    def poll() -> None:
        while not stop.is_set():
            t0, wall = time.perf_counter(), time.time()
            httpx.get(url + "/health", timeout=10)
            health.append((wall, time.perf_counter() - t0))
            time.sleep(0.02)

    threads.append(threading.Thread(target=poll))
    for t in threads:
        t.start()
    time.sleep(3)
    sent = subprocess.run(["nice", "-n", "19", sys.executable, "-c", SENDER, url], capture_output=True, text=True)
    stop.set()
    for t in threads:
        t.join(30)
    proc.terminate()
    proc.wait(30)
    cases = [json.loads(line) for line in sent.stdout.splitlines()]
    gaps = [(b[0], b[0] - a[0]) for lines in streams for a, b in zip(lines, lines[1:])]
    median = statistics.median(g for t, g in gaps if t < cases[0]["from"])
    for case in cases:
        during = [g for t, g in gaps if case["from"] <= t <= case["to"] + 0.05]
        case |= {"health_max_ms": 1000 * max(d for w, d in health if case["from"] - 0.05 <= w <= case["to"]),
                 "gap_max_ms": 1000 * max(during), "gap_median_before_ms": 1000 * median,
                 "gap_max_over_median": max(during) / median}
        del case["from"], case["to"]
    return cases


def idle_connections(count: int = 2000) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    proc, url = start(open_files=1024)
    address = url.removeprefix("http://").rsplit(":", 1)
    socks = [socket.create_connection((address[0], int(address[1]))) for _ in range(count)]
    for sock in socks[::2]:
        sock.send(b"GET /health HTTP/1.1\r\nHo")           # half of them a request head begun
    time.sleep(1)
    latencies = []
    for _ in range(100):
        t0 = time.perf_counter()
        httpx.get(url + "/health", timeout=10)
        latencies.append(1000 * (time.perf_counter() - t0))
    for sock in socks:
        sock.close()
    proc.terminate()
    log = proc.communicate(timeout=30)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {"idle_connections": count, "server_open_files": 1024, "health_p50_ms": statistics.median(latencies),
            "health_max_ms": max(latencies), "server_log_bytes": len(log)}


def sigterm() -> dict:
    proc, url = start("--shutdown-timeout", "10")
    streams = [[] for _ in range(8)]
    threads = [threading.Thread(target=stream, args=(url, 120 if i < 4 else 4000, lines))
               for i, lines in enumerate(streams)]
    for t in threads:
        t.start()
    while not all(streams):
        time.sleep(0.05)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    exited = time.time() - t0
    for t in threads:
        t.join(10)

    def ended(lines: list) -> str:
        last = lines[-1][1]
        return "[DONE]" if last == "data: [DONE]" else json.loads(last[6:])["error"]["code"]

    return {"exit_code": code, "exit_s": exited, "streams": [ended(lines) for lines in streams],
            "tokens_after_signal": [sum(t > t0 for t, _ in lines) for lines in streams],
            "tracebacks": proc.stderr.read().count("Traceback")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve-limits-cpu.json"))
    args = p.parse_args()
    # the machine's load: on a shared machine, compare each case with the controls, not across runs
    result = {"load_average_before": os.getloadavg(), "cpus": os.cpu_count(), "large_bodies": large_bodies(),
              "idle_connections": idle_connections(), "sigterm": sigterm(), "load_average_after": os.getloadavg()}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
