"""Load test of ``qllama serve`` on loopback, against llama-cpp-python's server on the same file.

    python benchmarks/serve_load.py [--file PATH] [--clients 1,4,16] [--requests 50]
                                    [--servers qllama,llama-cpp-python] [--json OUT] [--md OUT]

Each server runs in a process of its own on 127.0.0.1 (an ephemeral port), with ``--threads``
threads in every pool. For each client count, every client sends ``--requests`` requests, one
after the other, alternating a streamed greedy completion (``--max-tokens`` new tokens) and a
score (lm-eval's request: echo, logprobs 1, max_tokens 1, a shared context and one of several
answers). The checks: every answer is a 200 and complete (a stream ends with a finish reason
and ``[DONE]``, a score has one entry per prompt token plus one), no request is lost, and the
server's RSS after the last phase is within ``--rss-slack`` MB of its RSS after a warm-up
(two requests from each client of the largest phase, so that its caches are all made; qllama:
also nothing active or queued at the end). It prints throughput and p50/p99 latency
per phase; the client threads share the machine with the server, so the numbers are rough on
a busy machine. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MODEL, thread_env  # noqa: E402

PROMPTS = [
    "Explain how a CPU cache works.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "List three uses of a hash table.",
    "Why is the sky blue?",
    "Describe a binary search in one sentence.",
    "What does a compiler do?",
    "Give a tip for learning a language.",
]
CONTEXT = "Question: Which of these animals can fly? Answer:"
ANSWERS = [" a sparrow", " a dog", " a fish", " a horse"]
SERVERS = ("qllama", "llama-cpp-python")


@dataclass
class Outcome:
    kind: str  # "stream" or "score"
    seconds: float
    ok: bool
    tokens: int = 0  # new tokens (streams)
    first_token_s: float | None = None
    error: str = ""


@dataclass
class Phase:
    server: str
    clients: int
    requests: int
    wall_s: float
    errors: int
    lost: int
    req_per_s: float
    gen_tok_per_s: float
    p50_ms: float
    p99_ms: float
    stream_p50_ms: float
    stream_p99_ms: float
    score_p50_ms: float
    score_p99_ms: float
    ttft_p50_ms: float
    rss_mb: float
    first_errors: list[str] = field(default_factory=list)


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (linear between ranks), in milliseconds."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return 1000 * (s[lo] + (s[hi] - s[lo]) * (k - lo))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the servers --------------------------------------------------------------------------------


class Server:
    """A server process on loopback; ``url`` once it answers."""

    def __init__(self, kind: str, file: str, args: argparse.Namespace) -> None:
        self.kind = kind
        env = thread_env(args.threads)
        if kind == "qllama":
            root = str(HERE.parent)
            env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
            cmd = [
                sys.executable, "-m", "qllama.cli", "serve", f"model={file}", "--port", "0",
                "--max-sequences", str(args.max_sequences), "--max-queue", "1024",
                "--ctx", str(args.ctx), "--log-level", "warning",
            ]  # fmt: skip
        else:
            port = free_port()
            cmd = [
                args.llama_python, "-m", "llama_cpp.server", "--model", file, "--model_alias",
                "model", "--host", "127.0.0.1", "--port", str(port), "--n_threads",
                str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx",
                str(args.ctx),
                # by default a new request interrupts a running stream (it serves one at a time)
                "--interrupt_requests", "False",
            ]  # fmt: skip
            self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        self._wait(args.start_timeout)

    def _wait(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        if self.kind == "qllama":
            while time.monotonic() < deadline:
                line = self.proc.stderr.readline()
                if not line:
                    raise RuntimeError(f"qllama serve ended with status {self.proc.wait()}")
                if " on http://" in line:
                    self.url = line.rsplit(" on ", 1)[1].strip()
                    break
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # drain it
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} ended with status {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.kind} did not answer within {timeout:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- the clients --------------------------------------------------------------------------------


def stream(client: Any, url: str, prompt: str, max_tokens: int) -> Outcome:
    body = {
        "model": "model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t = time.perf_counter()
    first, chunks, usage, finish, done = None, 0, None, None, False
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return Outcome("stream", time.perf_counter() - t, False, error=f"{r.status_code}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[len("data: ") :])
            if data.get("usage"):
                usage = data["usage"]["completion_tokens"]
            for ch in data.get("choices", []):
                chunks += 1
                first = first or time.perf_counter() - t
                finish = ch.get("finish_reason") or finish
    s = time.perf_counter() - t
    ok = done and finish is not None
    return Outcome(
        "stream",
        s,
        ok,
        usage if usage is not None else chunks,
        first,
        "" if ok else "incomplete stream",
    )


def score(client: Any, url: str, prompt: str) -> Outcome:
    body = {
        "model": "model",
        "prompt": prompt,
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
    }
    t = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    s = time.perf_counter() - t
    if r.status_code != 200:
        return Outcome("score", s, False, error=f"{r.status_code}: {r.text[:100]}")
    doc = r.json()
    lp = doc["choices"][0]["logprobs"]
    n = doc["usage"]["prompt_tokens"]
    # llama-cpp-python leaves BOS out of the echoed arrays (and out of nothing else)
    ok = lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) in (n + 1, n)
    return Outcome(
        "score", s, ok, error="" if ok else f"{len(lp['token_logprobs'])} entries for {n} tokens"
    )


def client_loop(url: str, index: int, requests: int, max_tokens: int, out: list[Outcome]) -> None:
    import httpx

    with httpx.Client(timeout=600) as client:
        for i in range(requests):
            try:
                if (index + i) % 2 == 0:
                    out.append(stream(client, url, PROMPTS[(index + i) % len(PROMPTS)], max_tokens))
                else:
                    out.append(score(client, url, CONTEXT + ANSWERS[(index + i) % len(ANSWERS)]))
            except Exception as e:  # a broken connection is an error of the run, not the script
                out.append(Outcome("error", 0.0, False, error=f"{type(e).__name__}: {e}"))


def run_phase(server: Server, clients: int, requests: int, max_tokens: int) -> Phase:
    results: list[list[Outcome]] = [[] for _ in range(clients)]
    threads = [
        threading.Thread(target=client_loop, args=(server.url, c, requests, max_tokens, results[c]))
        for c in range(clients)
    ]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    flat = [o for r in results for o in r]
    lat = lambda kind: [o.seconds for o in flat if o.ok and (kind is None or o.kind == kind)]  # noqa: E731
    bad = [o for o in flat if not o.ok]
    return Phase(
        server=server.kind,
        clients=clients,
        requests=len(flat),
        wall_s=wall,
        errors=len(bad),
        lost=clients * requests - len(flat),
        req_per_s=len(flat) / wall,
        gen_tok_per_s=sum(o.tokens for o in flat if o.kind == "stream") / wall,
        p50_ms=pct(lat(None), 50),
        p99_ms=pct(lat(None), 99),
        stream_p50_ms=pct(lat("stream"), 50),
        stream_p99_ms=pct(lat("stream"), 99),
        score_p50_ms=pct(lat("score"), 50),
        score_p99_ms=pct(lat("score"), 99),
        ttft_p50_ms=pct([o.first_token_s for o in flat if o.first_token_s], 50),
        rss_mb=rss_mb(server.proc.pid),
        first_errors=[o.error for o in bad[:3]],
    )


def measure(kind: str, file: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then every client count; the RSS after warm-up and after the last phase."""
    import httpx

    server = Server(kind, file, args)
    try:
        # as many clients as the largest phase: the server's caches reach their steady number
        warm = run_phase(server, max(args.clients), 2, args.max_tokens)
        rss_warm = rss_mb(server.proc.pid)
        phases = []
        for n in args.clients:
            print(f"{kind}: {n} clients x {args.requests} requests ...", end=" ", flush=True)
            p = run_phase(server, n, args.requests, args.max_tokens)
            print(f"{p.wall_s:.0f} s, {p.errors} errors", flush=True)
            phases.append(asdict(p))
        rss_end = rss_mb(server.proc.pid)
        end_state = None
        if kind == "qllama":
            end_state = httpx.get(server.url + "/health", timeout=30).json()
        return {
            "server": kind,
            "warmup_errors": warm.errors,
            "rss_after_warmup_mb": rss_warm,
            "rss_end_mb": rss_end,
            "phases": phases,
            "end_state": end_state,
        }
    finally:
        server.stop()


def checks(result: dict[str, Any], slack: float) -> list[str]:
    """What failed, in words (nothing: the run passed)."""
    out = []
    for p in result["phases"]:
        if p["errors"] or p["lost"]:
            out.append(
                f"{result['server']} {p['clients']} clients: {p['errors']} errors, "
                f"{p['lost']} lost {p['first_errors']}"
            )
    growth = result["rss_end_mb"] - result["rss_after_warmup_mb"]
    if growth > slack:
        out.append(
            f"{result['server']}: RSS grew {growth:.0f} MB after warm-up (slack {slack:.0f})"
        )
    s = result.get("end_state")
    if s and (s["active"] or s["queued"] or s["retired_models_held"]):
        out.append(f"qllama: left running at the end: {s}")
    return out


def markdown(results: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    """The serving section of docs/bench.md."""
    lines = [
        "## Serving (`benchmarks/serve_load.py`)",
        "",
        f"{info['file']} on loopback, {info['threads']} threads per server, clients in the same "
        f"machine's load generator. Each client sends {info['requests']} requests one after the "
        f"other, alternating a streamed greedy completion ({info['max_tokens']} new tokens at "
        "most) and an lm-eval-style score (echo, logprobs 1, max_tokens 1; a shared context and "
        f"one of {len(ANSWERS)} answers). qllama: `qllama serve --max-sequences "
        f"{info['max_sequences']}` (numpy backend, the CPU arithmetic); llama-cpp-python: its "
        "server (one request at a time; `--interrupt_requests False`, else a new request cuts "
        "the running stream). Latencies are per request, complete answers.",
        "",
        "| server | clients | requests | errors / lost | wall s | req/s | gen tok/s | p50 ms "
        "| p99 ms | stream p50 / p99 ms | score p50 / p99 ms | first token p50 ms | RSS MB |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        for p in r["phases"]:
            lines.append(
                f"| {p['server']} | {p['clients']} | {p['requests']} | {p['errors']} / {p['lost']} "
                f"| {p['wall_s']:.1f} | {p['req_per_s']:.2f} | {p['gen_tok_per_s']:.1f} "
                f"| {p['p50_ms']:.0f} | {p['p99_ms']:.0f} | {p['stream_p50_ms']:.0f} / "
                f"{p['stream_p99_ms']:.0f} | {p['score_p50_ms']:.0f} / {p['score_p99_ms']:.0f} "
                f"| {p['ttft_p50_ms']:.0f} | {p['rss_mb']:.0f} |"
            )
    lines.append("")
    for r in results:
        lines.append(
            f"- {r['server']}: RSS {r['rss_after_warmup_mb']:.0f} MB after warm-up, "
            f"{r['rss_end_mb']:.0f} MB after the last phase."
        )
    failed = [c for r in results for c in checks(r, info["rss_slack"])]
    lines += ["", "Checks: " + ("all passed." if not failed else "; ".join(failed)), ""]
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", help="GGUF file (default: the SmolLM2 Q8_0 variant)")
    p.add_argument("--clients", default="1,4,16", help="client counts, one phase each")
    p.add_argument("--requests", type=int, default=50, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-sequences", type=int, default=16)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--rss-slack", type=float, default=64.0, help="MB the RSS may grow")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--llama-python", default=sys.executable, help="python with llama_cpp.server")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--md", help="write the markdown section here")
    args = p.parse_args(argv)
    args.clients = [int(x) for x in args.clients.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    file = args.file
    if file is None:
        from qllama.model_files import variant

        file = str(variant(MODEL, "Q8_0"))
    results = []
    for kind in args.servers.split(","):
        if kind not in SERVERS:
            print(f"unknown server {kind!r}; known: {', '.join(SERVERS)}", file=sys.stderr)
            return 1
        try:
            results.append(measure(kind, file, args))
        except RuntimeError as e:
            print(f"{kind}: {e}", file=sys.stderr)
            results.append(
                {
                    "server": kind,
                    "phases": [],
                    "rss_after_warmup_mb": 0,
                    "rss_end_mb": 0,
                    "error": str(e),
                }
            )
    info = {
        "file": Path(file).name,
        "threads": args.threads,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "max_sequences": args.max_sequences,
        "rss_slack": args.rss_slack,
        "load": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    lines = markdown(results, info)
    print("\n".join(lines))
    from qllama.atomic import atomic_write

    if args.json:
        with atomic_write(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    if args.md:
        with atomic_write(args.md, "w") as f:
            f.write("\n".join(lines))
    failed = [c for r in results for c in checks(r, args.rss_slack)] + [
        r["error"] for r in results if "error" in r
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
