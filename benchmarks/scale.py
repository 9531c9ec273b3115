"""The bench at scale (issue 17): qllama's CPU arithmetic against llama.cpp over model size.

A section of ``benchmarks/bench.py`` (``--only scale`` runs it alone, ``--no-scale`` skips it).
Sizes: 135M (the SmolLM2 Q8_0 and Q4_K_M files of the rest of the bench) and a 1B-shaped
synthetic llama (16 layers, 2048 wide, 32 heads / 8 KV heads, n_ff 8192, the synthetic gpt2
vocabulary, untied output) in Q8_0 and Q4_K; a 3B shape (28 layers, 3072 wide, 24 / 8 heads)
with ``--scale-3b``. Per size and file, each in a process of its own: decode tok/s after a
short prompt, teacher forcing of 256 tokens with every position's logits, peak RSS, and the
weight bandwidth of decoding (bytes of the 2-D weights streamed per token x tok/s) beside the
machine's copy bandwidth; then decode ms/token after 128, 1024 and 4096 positions (1B Q8_0).

The synthetic files are written once into ``<cache>/bench/`` by qllama's own writer. Speed
does not depend on the weights' values, so one layer is drawn and quantized
(:func:`qllama.synthetic.write_tiny` with one layer) and its bytes are written for every
layer: quantizing 1B weights to Q4_K with :mod:`qllama.quants` takes minutes, one layer
seconds. Each layer is still its own copy in the file, so every token streams all of them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import MODEL, chosen, fmt, memory_mb, run_worker

SECTION = "at scale"
TYPES = ("Q8_0", "Q4_K")  # the synthetic files' weight types
SMOL = {"Q8_0": "Q8_0", "Q4_K": "Q4_K_M"}  # the 135M file standing for each type
TF_TOKENS = 256
PROMPT = 16  # decode starts after this many tokens
CONTEXTS = (128, 1024, 4096)
CONTEXT_FILE = ("1B", "Q8_0")
CONTEXT_STEPS = 8  # timed decode steps at each context length, after 2 untimed
CHUNK = 512  # prefill in pieces of this many tokens (bounds attention's score matrix)
N_CTX = 8192  # context length written into the synthetic files


@dataclass(frozen=True)
class Shape:
    """A llama's shape; the synthetic files differ only in it and the weight type."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int


SHAPES = {
    "1B": Shape("1B", 16, 2048, 32, 8, 8192),
    "3B": Shape("3B", 28, 3072, 24, 8, 8192),
}


# --- the synthetic files -----------------------------------------------------------------------


def bench_config(weight_type: str, n_layer: int, n_ctx: int, **shape: Any) -> Any:
    """The :class:`qllama.synthetic.TinyConfig` of a bench's synthetic file (this section's,
    benchmarks/moe.py's): ``shape``'s widths and heads (and family, where not a llama) with
    ``n_layer`` layers and ``n_ctx`` positions, an untied output, the synthetic gpt2
    vocabulary."""
    from qllama.synthetic import TinyConfig

    return TinyConfig(
        n_layer=n_layer,
        n_ctx=n_ctx,
        tied=False,
        weight_type=weight_type,
        vocab="gpt2",
        **shape,
    )


def tiny_config(shape: Shape, weight_type: str, n_layer: int) -> Any:
    """The :class:`qllama.synthetic.TinyConfig` of ``shape`` with ``n_layer`` layers."""
    s = shape
    sizes = {"n_embd": s.n_embd, "n_ff": s.n_ff, "n_head": s.n_head, "n_head_kv": s.n_head_kv}
    return bench_config(weight_type, n_layer, N_CTX, **sizes)


def write_replicated(path: Path, cfg: Any) -> None:
    """Write ``cfg``'s model (a llama, or the family ``cfg.arch`` names) to ``path``
    (atomically) with one layer's weights in every layer."""
    from dataclasses import replace

    from qllama.ggml_types import ValueType
    from qllama.gguf.reader import GGUFValue, read_gguf
    from qllama.gguf.writer import GGUFWriter, copy_metadata
    from qllama.synthetic import write_tiny

    path.parent.mkdir(parents=True, exist_ok=True)
    block_count = f"{cfg.arch}.block_count"
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".one-layer-") as tmp:
        one = Path(tmp) / "one.gguf"
        write_tiny(one, replace(cfg, n_layer=1))
        with read_gguf(one) as f:
            w = GGUFWriter()
            copy_metadata(f, w, skip=[block_count])
            w.add(block_count, GGUFValue(ValueType.UINT32, cfg.n_layer))
            layer0 = [t for t in f if t.name.startswith("blk.0.")]
            for t in f:
                if not t.name.startswith("blk."):
                    w.add_tensor(t.name, f.tensor_data(t.name), t.ggml_type, t.shape)
            for layer in range(cfg.n_layer):  # layer by layer, as a converter writes them
                for t in layer0:
                    name = f"blk.{layer}." + t.name[len("blk.0.") :]
                    # a view of the one-layer file: nothing is copied until writing
                    w.add_tensor(name, f.tensor_data(t.name), t.ggml_type, t.shape)
            w.write(path)


def synthetic_file(shape: Shape, weight_type: str, n_layer: int) -> tuple[Path, dict[str, Any]]:
    """The cached synthetic file (written on first use) and how it was made: seconds taken."""
    s = shape
    name = f"llama-{n_layer}x{s.n_embd}-h{s.n_head}-kv{s.n_head_kv}-ff{s.n_ff}-{weight_type}.gguf"
    return cached_file(name, tiny_config(shape, weight_type, n_layer))


def cached_file(name: str, cfg: Any) -> tuple[Path, dict[str, Any]]:
    """The synthetic file of ``cfg`` named ``name`` in ``<cache>/bench/``, written (one layer
    replicated) on first use, and how it was made: seconds taken."""
    from qllama import defaults
    from qllama.atomic import atomic_write, exclusive

    path = defaults.cache_dir() / "bench" / name
    made = path.with_name(path.name + ".json")
    fresh = False
    with exclusive(path.with_name(path.name + ".lock")):  # one writer; the others wait
        if not (path.exists() and made.exists()):
            fresh = True
            print(f"  writing {path.name} ...", end=" ", flush=True)
            t = time.perf_counter()
            write_replicated(path, cfg)
            info = {"seconds": time.perf_counter() - t, "method": "one layer, replicated"}
            with atomic_write(made, "w") as f:
                json.dump(info, f)
            print(f"{info['seconds']:.0f} s", flush=True)
    return path, {**json.loads(made.read_text()), "written_now": fresh}


def streamed_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the weights one decode step reads in full: every 2-D tensor but the token
    embedding (a row lookup), which is counted only where it doubles as the output."""
    from qllama.gguf.reader import read_gguf

    with read_gguf(path) as f:
        names = {t.name: t for t in f}
    total = sum(t.nbytes for t in names.values() if len(t.ne) == 2)
    if "output.weight" in names:
        total -= names["token_embd.weight"].nbytes
    return total


def token_ids(n: int) -> list[int]:
    """``n`` fixed token ids valid in every file here (the synthetic vocabulary's 269 too)."""
    return [3 + (37 * i) % 250 for i in range(n)]


# --- workers (run by benchmarks/workers.py in a process of their own) --------------------------


def run_copy(job: dict) -> dict:
    """The machine's copy bandwidth: numpy copies of a ``mb`` MB buffer by 1 and by ``threads``
    threads (each a slice; numpy lets go of the GIL), best of ``repeats``; GB/s counts the bytes
    read and written (STREAM's convention: 2 x the buffer)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    src = np.ones(job["mb"] * 2**20 // 8)
    dst = np.zeros_like(src)  # zeros: the pages are touched before any timing
    out = {}
    for n in sorted({1, job["threads"]}):
        cuts = np.linspace(0, src.size, n + 1).astype(int)
        parts = list(itertools.pairwise(cuts))
        with ThreadPoolExecutor(n) as pool:
            best = float("inf")
            for _ in range(job["repeats"]):
                t = time.perf_counter()
                list(pool.map(lambda ab: np.copyto(dst[ab[0] : ab[1]], src[ab[0] : ab[1]]), parts))
                best = min(best, time.perf_counter() - t)
        out[f"copy_gb_s_{n}"] = 2 * src.nbytes / best / 1e9
    return out


def _context_rate(prefill: Any, step: Any, ids: list[int], job: dict) -> dict:
    """Decode ms/token at each context length: extend the prefill to it (chunks of
    ``CHUNK``), time ``CONTEXT_STEPS`` steps after 2 untimed, then go back to it."""
    done, out = 0, {}
    for n in job["contexts"]:
        t = time.perf_counter()
        for a in range(done, n, CHUNK):
            prefill(ids[a : min(n, a + CHUNK)], a)
        out[f"prefill_{n}_s"] = time.perf_counter() - t
        times = []
        for i in range(2 + job["steps"]):
            t = time.perf_counter()
            step(ids[n + i], n + i)
            times.append(time.perf_counter() - t)
        out[str(n)] = 1e3 * statistics.median(times[2:])
        done = n  # the next prefill writes from here, over the decoded positions
    return out


def run_context_qllama(job: dict) -> dict:
    """qllama's CPU arithmetic (numba kernels): decode ms/token against context length."""
    import numba

    import qllama
    from qllama.array_api import to_numpy
    from qllama.backends.numpy.kernels import matmul  # noqa: F401  (as the other rows load it)

    numba.set_num_threads(job["threads"])
    model = qllama.load(job["file"], backend="numpy", kernels="numba", threads=job["threads"])

    def prefill(ids: list[int], pos: int) -> None:
        to_numpy(model.forward(ids, pos))

    def step(token: int, pos: int) -> None:
        to_numpy(model.forward([token], pos))

    ids = token_ids(max(job["contexts"]) + 2 + job["steps"])
    return {"ms_per_token": _context_rate(prefill, step, ids, job), **memory_mb()}


def run_context_llama_cpp(job: dict) -> dict:
    """llama.cpp through llama-cpp-python: decode ms/token against context length."""
    import llama_cpp

    ids = token_ids(max(job["contexts"]) + 2 + job["steps"])
    llm = llama_cpp.Llama(
        model_path=job["file"],
        n_ctx=len(ids),
        n_batch=CHUNK,
        n_ubatch=CHUNK,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
    )

    def prefill(chunk: list[int], pos: int) -> None:
        llm.n_tokens = pos  # eval drops the cache from here on
        llm.eval(chunk)

    def step(token: int, pos: int) -> None:
        llm.n_tokens = pos
        llm.eval([token])

    return {"ms_per_token": _context_rate(prefill, step, ids, job), **memory_mb()}


WORKERS = {
    "copy": run_copy,
    "context_qllama": run_context_qllama,
    "context_llama_cpp": run_context_llama_cpp,
}


# --- the section ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The section's options of benchmarks/bench.py."""
    p.add_argument("--no-scale", action="store_true", help="skip the section 'At scale'")
    p.add_argument("--scale-3b", action="store_true", help="add the 3B shape to 'At scale'")
    p.add_argument("--scale-layers", type=int, help=argparse.SUPPRESS)  # shrink, for checks
    p.add_argument("--copy-mb", type=int, default=1024, help=argparse.SUPPRESS)


def selected(args: argparse.Namespace) -> bool:
    """Whether bench.py runs the section: not ``--no-scale``, and ``--only`` names it."""
    return not args.no_scale and chosen(args.only, SECTION)


def run(args: argparse.Namespace, llama_note: str | None) -> dict[str, Any]:
    """Every measurement of the section; what :func:`markdown` reads."""
    from qllama.model_files import variant
    from qllama.synthetic import vocabulary

    def go(what: str, job: dict, python: str = sys.executable, slow: bool = False) -> dict | None:
        print(f"at scale: {what} ...", end=" ", flush=True)
        timeout = 4 * args.timeout if slow else args.timeout  # slow: 4096 positions of prefill
        out = run_worker({**job, "threads": args.threads}, python, args.threads, timeout)
        print(f"{out.seconds:.0f} s" + (f"  FAILED: {out.error}" if out.error else ""), flush=True)
        if out.error:
            failed.append(f"{what}: {out.error}")
        return out.result

    failed: list[str] = []
    files: dict[tuple[str, str], dict[str, Any]] = {}
    for ft in TYPES:
        path = variant(MODEL, SMOL[ft])
        files["135M", ft] = {"path": str(path), "name": SMOL[ft]}
    shapes = [SHAPES["1B"], *([SHAPES["3B"]] if args.scale_3b else [])]
    for shape in shapes:
        layers = args.scale_layers or shape.n_layer
        for ft in TYPES:
            path, made = synthetic_file(shape, ft, layers)
            files[shape.name, ft] = {"path": str(path), "name": ft, "made": made}
    sizes = ["135M", *(sh.name for sh in shapes)]
    for f in files.values():
        f["mb"] = os.path.getsize(f["path"]) / 1e6
        f["streamed_mb"] = streamed_bytes(f["path"]) / 1e6

    copy = go("copy bandwidth", {"kind": "copy", "mb": args.copy_mb, "repeats": 5})
    ids = token_ids(TF_TOKENS)
    common = {"ids": ids, "prompt_len": PROMPT, "repeats": args.repeats}
    common |= {"decode_steps": args.decode_steps, "warmup_steps": 4}
    rows: dict[str, Any] = {}
    for (size, ft), f in files.items():
        go(f"numba kernels for {size} {ft}", {"kind": "warm", "file": f["path"]})  # no JIT later
        key = f"{size} {ft}"
        options = {"kernels": "numba"}
        job = {"kind": "qllama", "backend": "numpy", "options": options, "file": f["path"]}
        rows[key] = {"size": size, "type": ft, **f}
        rows[key]["qllama"] = go(f"{key} qllama", {**job, **common})
        if llama_note:
            continue
        for logits_all in (False, True):
            job = {"kind": "llama_cpp", "file": f["path"], "logits_all": logits_all}
            name = "llama.cpp" + (" (logits_all)" if logits_all else "")
            got = go(f"{key} {name}", {**job, **common}, args.llama_python)
            rows[key]["llama_all" if logits_all else "llama"] = got

    context: dict[str, Any] = {"file": files[CONTEXT_FILE]["path"]}
    job = {"file": context["file"], "contexts": list(CONTEXTS), "steps": CONTEXT_STEPS}
    context["qllama"] = go("context qllama", {**job, "kind": "context_qllama"}, slow=True)
    if not llama_note:
        job["kind"] = "context_llama_cpp"
        context["llama"] = go("context llama.cpp", job, args.llama_python, slow=True)
    return {
        "sizes": sizes,
        "n_vocab": len(vocabulary()[0]),
        "rows": rows,
        "copy": copy,
        "context": context,
        "layers": args.scale_layers,
        "shapes": {s.name: vars(s) for s in shapes},
        "threads": args.threads,
        "repeats": args.repeats,
        "decode_steps": args.decode_steps,
        "llama_note": llama_note,
        "failed": failed,
    }


# --- the report -----------------------------------------------------------------------------


def _get(d: dict | None, key: str) -> float | None:
    return None if d is None else d.get(key)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None where either is missing (or ``b`` is 0)."""
    return a / b if a is not None and b else None


def _measures(row: dict[str, Any]) -> dict[str, float | None]:
    """One file's numbers: decode and teacher forcing tok/s of both, GB/s, peak RSS."""
    q, lc, la = row.get("qllama"), row.get("llama"), row.get("llama_all")
    m = {
        "q_decode": _get(q, "decode_tok_s"),
        "l_decode": _get(lc, "decode_tok_s"),
        "q_tf": _get(q, "tf_tok_s"),
        "l_tf": _get(la, "pp_tok_s"),
        "q_rss_gen": _get(q, "generate_peak_rss_mb"),
        "q_rss": _get(q, "peak_rss_mb"),
        "l_rss_gen": _get(lc, "peak_rss_mb"),
        "l_rss": _get(la, "peak_rss_mb"),
    }
    gb = row["streamed_mb"] / 1e3
    m["q_gb_s"] = m["q_decode"] and gb * m["q_decode"]
    m["l_gb_s"] = m["l_decode"] and gb * m["l_decode"]
    return m


def markdown(s: dict[str, Any]) -> list[str]:
    """The section "At scale" of docs/bench.md."""
    copy = s.get("copy") or {}
    n = s["threads"]
    bw = f"{fmt(copy.get(f'copy_gb_s_{n}'))} GB/s with {n} threads"
    bw += f", {fmt(copy.get('copy_gb_s_1'))} with 1" if n != 1 else ""
    shapes = "; ".join(
        f"{k}: {v['n_layer']} layers, {v['n_embd']} wide, {v['n_head']} heads / {v['n_head_kv']} "
        f"KV heads, n_ff {v['n_ff']}"
        for k, v in s["shapes"].items()
    )
    made = [
        f"{r['size']} {r['name']} {r['made']['seconds']:.0f} s"
        for r in s["rows"].values()
        if r.get("made")
    ]
    out = [
        "## At scale",
        "",
        f"qllama's CPU arithmetic (numpy backend, numba kernels, {n} threads) against llama.cpp "
        "(llama-cpp-python) over model size, each file in a process of its own, pinned as above. "
        "135M: the SmolLM2 Q8_0 and Q4_K_M files. The larger sizes are synthetic llamas written "
        f"by qllama's own writer ({shapes}; the synthetic gpt2 vocabulary of {s['n_vocab']} "
        "tokens, untied output) in Q8_0 and Q4_K: one layer drawn at random and quantized by "
        "`qllama.quants`, its bytes written for every layer (speed does not depend on the "
        "values; each layer is its own copy in the file)"
        + (f"; writing them took {', '.join(made)} (once, then cached)" if made else "")
        + ".",
        "",
        f"Decode: {s['decode_steps']} timed steps after a {PROMPT}-token prompt and 4 warm-up "
        f"steps; teacher forcing: {TF_TOKENS} tokens with every position's logits (llama.cpp: "
        f"`logits_all`); medians of {s['repeats']} runs. **GB/s**: bytes of the 2-D weights one "
        "decode step streams (all but the token embedding, which is a row lookup unless it is "
        "also the output) x decode tok/s. The machine's copy bandwidth, measured in the same run "
        f"(numpy copy of a 1 GB buffer, best of 5, read + write counted): {bw}. Peak RSS: VmHWM "
        "after generating / at the end (after teacher forcing; llama.cpp: its two runs).",
        "",
    ]
    ran = sorted(
        {
            f"{who} {r[key]['isa']}"
            for r in s["rows"].values()
            for who, key in (("qllama", "qllama"), ("llama.cpp", "llama"))
            if r.get(key) and r[key].get("isa")
        }
    )
    if ran:
        out += [f"Instructions the workers reported: {', '.join(ran)}.", ""]
    if s.get("layers"):
        out += [
            f"**Reduced run**: the synthetic shapes with {s['layers']} layers (`--scale-layers`); "
            "not the full sizes.",
            "",
        ]
    out += [
        "| size | file | MB | streamed MB | decode tok/s: qllama / llama.cpp | ratio "
        "| GB/s: qllama / llama.cpp | TF tok/s: qllama / llama.cpp | ratio "
        "| peak RSS MB qllama | peak RSS MB llama.cpp |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in s["rows"].values():
        m = _measures(r)
        out.append(
            f"| {r['size']} | {r['name']} | {r['mb']:.0f} | {r['streamed_mb']:.0f} "
            f"| {fmt(m['q_decode'])} / {fmt(m['l_decode'])} "
            f"| {fmt(ratio(m['q_decode'], m['l_decode']), '{:.2f}x')} "
            f"| {fmt(m['q_gb_s'])} / {fmt(m['l_gb_s'])} "
            f"| {fmt(m['q_tf'])} / {fmt(m['l_tf'])} "
            f"| {fmt(ratio(m['q_tf'], m['l_tf']), '{:.2f}x')} "
            f"| {fmt(m['q_rss_gen'], '{:.0f}')} / {fmt(m['q_rss'], '{:.0f}')} "
            f"| {fmt(m['l_rss_gen'], '{:.0f}')} / {fmt(m['l_rss'], '{:.0f}')} |"
        )
    out += ["", *scaling_md(s), "", *context_md(s), "", *targets_md(s)]
    if s.get("failed"):
        out += ["", "Failed:", "", *[f"- {f}" for f in s["failed"]]]
    return [*out, ""]


def scaling_md(s: dict[str, Any]) -> list[str]:
    """tok/s and the ratio to llama.cpp over model size."""
    sizes = s["sizes"]
    out = [
        "Scaling over model size (tok/s, qllama / llama.cpp = ratio; 135M's Q4_K column is "
        "its Q4_K_M file):",
        "",
        "| measure | " + " | ".join(sizes) + " |",
        "|---|" + "--:|" * len(sizes),
    ]
    for what, q, lc in (("decode", "q_decode", "l_decode"), ("teacher forcing", "q_tf", "l_tf")):
        for ft in TYPES:
            cells = []
            for size in sizes:
                row = s["rows"].get(f"{size} {ft}")
                m = _measures(row) if row else {}
                x = ratio(m.get(q), m.get(lc))
                cells.append(f"{fmt(m.get(q))} / {fmt(m.get(lc))} = {fmt(x, '{:.2f}x')}")
            out.append(f"| {what}, {ft} | " + " | ".join(cells) + " |")
    return out


def context_md(s: dict[str, Any]) -> list[str]:
    """Decode ms/token against context length."""
    c = s["context"]
    q = (c.get("qllama") or {}).get("ms_per_token", {})
    lc = (c.get("llama") or {}).get("ms_per_token", {})
    size, ft = CONTEXT_FILE
    out = [
        f"Decode against context length, {size} {ft}: ms/token (median of {CONTEXT_STEPS} "
        f"steps after 2) once that many positions are in the KV cache (prefilled in chunks of "
        f"{CHUNK}; llama.cpp with n_ctx large enough, its f16 cache; qllama's f32 cache):",
        "",
        "| positions | qllama ms/token | llama.cpp ms/token | ratio (llama.cpp / qllama) |",
        "|--:|--:|--:|--:|",
    ]
    for n in CONTEXTS:
        a, b = q.get(str(n)), lc.get(str(n))
        out.append(f"| {n} | {fmt(a)} | {fmt(b)} | {fmt(ratio(b, a), '{:.2f}x')} |")
    return out


def targets_md(s: dict[str, Any]) -> list[str]:
    """Issue 17's targets at 1B: decode >= 0.8x and teacher forcing >= 1x llama.cpp, and
    peak RSS <= file + 10% + KV cache + 100 MB."""
    out = ["Targets at 1B (issue 17):", ""]
    shape = s["shapes"].get("1B")
    for ft in TYPES:
        row = s["rows"].get(f"1B {ft}")
        if row is None or shape is None:
            continue
        m = _measures(row)
        for what, q, lc, goal in (
            ("decode", "q_decode", "l_decode", 0.8),
            ("teacher forcing", "q_tf", "l_tf", 1.0),
        ):
            x = ratio(m[q], m[lc])
            ok = "not measured" if x is None else ("**met**" if x >= goal else "**missed**")
            out.append(f"- {ft} {what} >= {goal:g}x llama.cpp: {fmt(x, '{:.2f}x')}: {ok}")
        layers = s.get("layers") or shape["n_layer"]
        head_dim = shape["n_embd"] // shape["n_head"]
        kv = 2 * layers * TF_TOKENS * shape["n_head_kv"] * head_dim * 4 / 1e6  # f32 K and V
        limit = 1.1 * row["mb"] + kv + 100
        rss = m["q_rss"]
        ok = "not measured" if rss is None else ("**met**" if rss <= limit else "**missed**")
        out.append(
            f"- {ft} peak RSS <= 1.1 x {row['mb']:.0f} MB + {kv:.0f} MB KV cache + 100 MB = "
            f"{limit:.0f} MB: {fmt(rss, '{:.0f}')} MB: {ok}"
        )
    return out
