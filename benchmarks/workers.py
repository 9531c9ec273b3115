"""Measurements, one configuration per process: ``python benchmarks/bench.py --worker JOB``.

Each worker loads one model (qllama on one backend and mode, transformers, or llama.cpp
through llama-cpp-python), times load, prefill, all-position teacher forcing and step-by-step
decoding on the same token ids, reads its peak RSS, and prints one JSON line. It imports
only what its kind needs: the llama.cpp worker runs in any environment that has
llama-cpp-python and numpy, without qllama.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import scale
from common import memory_mb, pin_cpus


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def decode_rate(
    start: Callable[[], None], step: Callable[[int, int], None], ids: list[int], job: dict
) -> tuple[float, list[float]]:
    """Tokens/s of step-by-step decoding after a prefill of the prompt: the median over
    ``repeats`` runs of ``decode_steps`` steps (the first ``warmup_steps`` are not timed)."""
    n_prompt, steps, warm = job["prompt_len"], job["decode_steps"], job["warmup_steps"]
    rates = []
    for _ in range(job["repeats"]):
        start()
        for i in range(warm):
            step(ids[n_prompt + i], n_prompt + i)
        t = time.perf_counter()
        for i in range(warm, warm + steps):
            step(ids[n_prompt + i], n_prompt + i)
        rates.append(steps / (time.perf_counter() - t))
    return statistics.median(rates), rates


# --- qllama ---------------------------------------------------------------------------------


def run_qllama(job: dict) -> dict:
    """One qllama backend and mode on one file, on ``job["device"]`` (or the default)."""
    if job["backend"] == "torch":
        import torch

        torch.set_num_threads(job["threads"])
    before_import = memory_mb()["rss_mb"]
    import qllama
    from qllama.array_api import to_numpy  # waits for the device, copies to the host

    options = dict(job["options"])
    isa = None  # the compiled kernels' instructions, where they run
    if job["backend"] == "numpy" and options.get("kernels", "numba") == "numba":
        import numba

        from qllama.backends.numpy.kernels import matmul  # noqa: F401  (its import cost is measured)

        numba.set_num_threads(job["threads"])
        options.setdefault("threads", job["threads"])
        isa = kernel_isa()
    after_import = memory_mb()["rss_mb"]
    ids, n = job["ids"], len(job["ids"])
    t = time.perf_counter()
    model = qllama.load(job["file"], backend=job["backend"], device=job.get("device"), **options)
    load_s = time.perf_counter() - t

    def tf() -> Any:
        return to_numpy(model.forward(ids, 0, all_logits=True))

    def prefill() -> Any:
        return to_numpy(model.forward(ids, 0))

    def start() -> None:
        to_numpy(model.forward(ids[: job["prompt_len"]], 0))

    def step(token: int, pos: int) -> None:
        to_numpy(model.forward([token], pos))

    # generation first: its peak memory, before the all-position logits of teacher forcing
    decode, rates = decode_rate(start, step, ids, job)
    generate_peak = memory_mb()["peak_rss_mb"]
    first = timed(tf, 1)[0]  # compiles (jax), loads cached kernels (numba), touches pages
    tf_times = timed(tf, job["repeats"])
    prefill_times = timed(prefill, job["repeats"])
    result = {
        "load_s": load_s,
        "first_call_s": first,
        "tf_tok_s": n / statistics.median(tf_times),
        "prefill_tok_s": n / statistics.median(prefill_times),
        "decode_tok_s": decode,
        "decode_runs": rates,
        "import_rss_mb": after_import - before_import,
        "generate_peak_rss_mb": generate_peak,
        "isa": isa,
        **memory_mb(),
    }
    if job.get("profile"):
        result["profile"] = profile_qllama(model, ids, job)
    return result


def kernel_isa() -> str:
    """The instructions qllama's compiled kernels are built for in this process."""
    from qllama.backends.numpy.kernels import llvm_ir, simd

    if llvm_ir.AVX512:
        return "AVX-512" + (" VNNI" if simd.VNNI else "")
    return "AVX2" if llvm_ir.AVX2 else "portable"


# the backend's product calls: the model reaches matmuls and expert_matmul through the class
PRODUCTS = ("matmul", "matmuls", "expert_matmul")


def profile_qllama(model: Any, ids: list[int], job: dict) -> dict:
    """Where a decode step and a teacher-forcing pass spend their time: inside the backend's
    products (``matmul``, the fused ``matmuls`` and ``expert_matmul``: the quantized
    products) or in the rest of the forward (array-API code). The products are timed on the
    backend's class, where the model looks them up, and once where one calls another."""
    from qllama.array_api import to_numpy

    cls = type(model.backend)
    spent, depth = [0.0], [0]
    plain = {name: getattr(cls, name) for name in PRODUCTS if hasattr(cls, name)}
    inherited = {name for name in plain if name not in cls.__dict__}

    def timed(f: Any) -> Any:
        def product(*args: Any) -> Any:
            depth[0] += 1
            t = time.perf_counter()
            try:
                return f(*args)
            finally:
                depth[0] -= 1
                if not depth[0]:  # the outermost product call only
                    spent[0] += time.perf_counter() - t

        return product

    for name, f in plain.items():
        setattr(cls, name, timed(f))
    try:
        n_prompt, steps = job["prompt_len"], job["decode_steps"]
        to_numpy(model.forward(ids[:n_prompt], 0))
        spent[0] = 0.0
        t = time.perf_counter()
        for i in range(steps):
            to_numpy(model.forward([ids[n_prompt + i]], n_prompt + i))
        total = time.perf_counter() - t
        decode = {"ms_per_token": 1e3 * total / steps, "matmul_ms": 1e3 * spent[0] / steps}
        spent[0] = 0.0
        t = time.perf_counter()
        to_numpy(model.forward(ids, 0, all_logits=True))
        total = time.perf_counter() - t
        tf = {"s": total, "matmul_s": spent[0]}
    finally:
        for name, f in plain.items():
            if name in inherited:  # the base class's again
                delattr(cls, name)
            else:
                setattr(cls, name, f)
    return {"decode": decode, "tf": tf}


def run_observer(job: dict) -> dict:
    """Decode with no observer and with a no-op one, rounds alternating so both see the same
    machine (benchmarks/observer_overhead.py): the hook's cost when no observer is given is
    at most the no-op observer's, whose calls it skips."""
    # not at the top: it imports numpy, whose memory run_qllama counts in qllama's import
    from observer_overhead import alternate

    import qllama

    model = qllama.load(job["file"], backend="numpy", threads=job["threads"])
    prompt = job["ids"][: job["prompt_len"]]
    ms = alternate(model, prompt, job["decode_steps"], job["repeats"])
    return {
        "median_ms_per_step": {k: statistics.median(v) for k, v in ms.items()},
        "rounds": ms,
    }


def run_ids(job: dict) -> dict:
    """The benchmark's token ids: the chat prompt, then ``new_tokens`` greedy tokens of qllama
    (dequantize-all, the F32 file), end-of-turn ignored so that the length is fixed."""
    import qllama
    from qllama.runtime.generation import Sampler, generate_ids

    model = qllama.load(job["file"], dequantize_all=True)
    prompt = model.apply_chat_template(job["messages"])
    greedy = generate_ids(model, prompt, max_new_tokens=job["new_tokens"], sampler=Sampler())
    ids = [*prompt, *greedy]  # no stop ids: the length is fixed
    stops = set(model.tokenizer.stop_ids)
    first_stop = next((i for i, t in enumerate(ids[len(prompt) :]) if t in stops), None)
    return {"ids": ids, "prompt_len": len(prompt), "first_stop": first_stop}


def run_warm(job: dict) -> dict:
    """Compile (or find in numba's disk cache) every kernel a file's matmuls use, so that no
    measured process compiles: compiling takes seconds and hundreds of MB of memory."""
    import qllama
    from qllama.array_api import to_numpy

    t = time.perf_counter()
    model = qllama.load(job["file"], kernels="numba", threads=job["threads"])
    ids = list(range(1, 21))
    to_numpy(model.forward(ids, 0, all_logits=True))  # many tokens
    to_numpy(model.forward([7], len(ids)))  # one token
    return {"seconds": time.perf_counter() - t}


# --- peers ------------------------------------------------------------------------------------


def run_transformers(job: dict) -> dict:
    """transformers, f32, eager attention, on the F32 file (gguf_file=)."""
    import torch

    torch.set_num_threads(job["threads"])
    from transformers import AutoModelForCausalLM, DynamicCache

    path = job["file"]
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path),
        gguf_file=os.path.basename(path),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    model.eval()
    load_s = time.perf_counter() - t
    ids = job["ids"]
    x = torch.tensor([ids])
    cache: list[Any] = [None]

    with torch.inference_mode():

        def start() -> None:
            cache[0] = DynamicCache(config=model.config)
            model(x[:, : job["prompt_len"]], past_key_values=cache[0], use_cache=True)

        def step(token: int, pos: int) -> None:
            model(torch.tensor([[token]]), past_key_values=cache[0], use_cache=True)

        decode, rates = decode_rate(start, step, ids, job)
        generate_peak = memory_mb()["peak_rss_mb"]
        first = timed(lambda: model(x).logits, 1)[0]
        tf_times = timed(lambda: model(x).logits, job["repeats"])
        prefill_times = timed(lambda: model(x, logits_to_keep=1).logits, job["repeats"])
    import transformers

    return {
        "load_s": load_s,
        "first_call_s": first,
        "tf_tok_s": len(ids) / statistics.median(tf_times),
        "prefill_tok_s": len(ids) / statistics.median(prefill_times),
        "decode_tok_s": decode,
        "decode_runs": rates,
        "generate_peak_rss_mb": generate_peak,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        **memory_mb(),
    }


def run_llama_cpp(job: dict) -> dict:
    """llama.cpp through llama-cpp-python: prompt processing (last logits, or every
    position's with ``logits_all``) and step-by-step decoding."""
    import llama_cpp

    ids = job["ids"]
    t = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=job["file"],
        n_ctx=512,
        n_batch=512,
        n_ubatch=512,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        logits_all=job["logits_all"],
        verbose=False,
    )
    load_s = time.perf_counter() - t

    def pp() -> None:
        llm.reset()
        llm.eval(ids)

    first = timed(pp, 1)[0]
    pp_times = timed(pp, job["repeats"])
    result = {
        "load_s": load_s,
        "first_call_s": first,
        "pp_tok_s": len(ids) / statistics.median(pp_times),
        "versions": {"llama-cpp-python": llama_cpp.__version__},
        "isa": "AVX-512" if b"AVX512 = 1" in llama_cpp.llama_print_system_info() else "AVX2",
    }
    if not job["logits_all"]:

        def start() -> None:
            llm.reset()
            llm.eval(ids[: job["prompt_len"]])

        def step(token: int, pos: int) -> None:
            llm.eval([token])

        result["decode_tok_s"], result["decode_runs"] = decode_rate(start, step, ids, job)
    result.update(memory_mb())
    return result


# --- corpus perplexity ----------------------------------------------------------------------


def run_perplexity(job: dict) -> dict:
    """qllama perplexity over the corpus's first ``windows`` windows of ``n_ctx``: tokens/s
    of the scoring loop (windows x n_ctx tokens over its wall time; one window of warm-up)."""
    import qllama
    from qllama.measure import corpus, perplexity

    options = dict(job["options"])
    if options.pop("as_llama_cpp", False):
        options.update(perplexity.LLAMA_CPP_CPU)
    if options.get("kernels", "numba") == "numba" and not options.get("dequantize_all"):
        import numba

        numba.set_num_threads(job["threads"])
        options.setdefault("threads", job["threads"])
    model = qllama.load(job["file"], n_ctx=job["n_ctx"], **options)
    ids = perplexity.tokenize(model.tokenizer, corpus.text(job["corpus"]))
    wins = perplexity.windows(ids, job["n_ctx"], n_chunks=job["windows"])
    score = perplexity.qllama_scorer(model)
    score(wins.evaluated(0), wins.first)  # warm-up: numba's cached kernels, first touches
    t = time.perf_counter()
    scores = perplexity.run(score, wins)
    seconds = time.perf_counter() - t
    return {
        "ppl_tok_s": wins.n_chunk * wins.n_ctx / seconds,
        "ppl": scores.ppl()[0],
        "windows": wins.n_chunk,
        **memory_mb(),
    }


def run_llama_perplexity(job: dict) -> dict:
    """llama-perplexity (the tools' binary) on the same text and windows: tokens/s from its
    own prompt-eval timing (the decode calls), and from its wall time less loading."""
    import re
    import subprocess
    import tempfile

    from qllama.measure import corpus

    text = corpus.text(job["corpus"])
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        cmd = [os.path.join(job["llama_bin"], "llama-perplexity"), "-m", job["file"], "-f"]
        cmd += [f.name, "-c", str(job["n_ctx"]), "-b", str(job["n_ctx"])]
        cmd += ["-t", str(job["threads"]), "--chunks", str(job["windows"]), "-ngl", "0"]
        t = time.perf_counter()
        env = {**os.environ, "LD_LIBRARY_PATH": job["llama_bin"]}  # its shared libraries
        run = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False, env=env
        )  # one stream: its log lines in order, each whole
        wall = time.perf_counter() - t
    out = run.stdout
    if run.returncode != 0:
        raise RuntimeError(out.strip().splitlines()[-1] if out.strip() else "failed")
    # the scoring loop: from its "calculating perplexity" line to "Final estimate", by the
    # log's own timestamps (minutes.seconds.milliseconds.microseconds; this build prints no
    # perf lines)
    stamp = r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I "
    begin = re.search(stamp + r"perplexity: calculating", out, re.M)
    end = re.search(stamp + r"Final estimate: PPL = ([\d.]+)", out, re.M)

    def seconds(m: re.Match[str]) -> float:
        mi, se, ms, us = (int(x) for x in m.groups()[:4])
        return 60 * mi + se + ms / 1e3 + us / 1e6

    tokens = job["windows"] * job["n_ctx"]
    loop = seconds(end) - seconds(begin) if begin and end else None
    result = {
        "ppl_tok_s": tokens / loop if loop else None,
        "wall_tok_s": tokens / wall,
        "ppl": float(end.group(5)) if end else None,
        "windows": job["windows"],
    }
    return result


def run_scale(job: dict) -> dict:
    """The section "At scale"'s own kinds (benchmarks/scale.py): copy bandwidth, decode
    against context length."""
    return scale.WORKERS[job["kind"]](job)


KINDS: dict[str, Callable[[dict], dict]] = {
    "qllama": run_qllama,
    "ids": run_ids,
    "warm": run_warm,
    "transformers": run_transformers,
    "llama_cpp": run_llama_cpp,
    "perplexity": run_perplexity,
    "llama_perplexity": run_llama_perplexity,
    "observer": run_observer,
    "copy": run_scale,
    "context_qllama": run_scale,
    "context_llama_cpp": run_scale,
}


def main(job_json: str) -> None:
    job = json.loads(job_json)
    job["cpus"] = pin_cpus(job.get("threads", 2))
    result = KINDS[job["kind"]](job)
    print("RESULT " + json.dumps(result), flush=True)
