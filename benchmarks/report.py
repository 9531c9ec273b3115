"""docs/bench.md from the benchmark's outcomes: the table, the targets, the profile, the setup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import CPU_ROWS, LLAMA_CPP, LLAMA_PERPLEXITY, PPL_CTX, TRANSFORMERS, Config, Outcome
from scale import markdown as scale_md
from serve_load import markdown as serving_md

Row = dict[str, Any]


def rows(outcomes: dict[str, tuple[Config, Outcome]]) -> tuple[list[Row], list[str]]:
    """One row per (setting, file), llama.cpp's two runs merged; and the failures."""
    table: dict[tuple[str, str], Row] = {}
    failed = []
    for key, (c, out) in outcomes.items():
        if c.job["kind"] in PERPLEXITY_KINDS:
            continue  # their own section
        if out.result is None:
            failed.append(f"{key}: {out.error}")
            continue
        r = out.result
        row = table.setdefault((c.label, c.file), {"label": c.label, "file": c.file})
        if c.job["kind"] == "llama_cpp":
            if c.job["logits_all"]:
                row["tf_tok_s"] = r["pp_tok_s"]
                row["peak_rss_mb"] = r["peak_rss_mb"]
            else:
                row.update(prefill_tok_s=r["pp_tok_s"], decode_tok_s=r["decode_tok_s"])
                row.update(load_s=r["load_s"], generate_peak_rss_mb=r["peak_rss_mb"])
        else:
            row.update(r)
    return list(table.values()), failed


PERPLEXITY_KINDS = ("perplexity", "llama_perplexity")


def perplexity_md(outcomes: dict[str, tuple[Config, Outcome]], info: dict[str, Any]) -> list[str]:
    """Corpus perplexity at n_ctx 512: tokens/s of each setting, and the targets (issue 14)."""
    got = {
        (c.label, c.file): out for c, out in outcomes.values() if c.job["kind"] in PERPLEXITY_KINDS
    }
    if not got:
        return []
    out = [
        f"## Corpus perplexity (n_ctx {PPL_CTX}, {info['ppl_windows']} windows of the Botchan "
        "corpus)",
        "",
        "Tokens/s: windows x n_ctx tokens over the scoring loop's wall time (qllama, after one "
        "window of warm-up); llama-perplexity: its own prompt-eval time (the decode calls), and "
        "in brackets its wall time less loading. Same file, same text, same windows.",
        "",
        "| setting | file | tokens/s | PPL |",
        "|---|---|--:|--:|",
    ]
    for (label, ft), o in got.items():
        r = o.result or {}
        extra = f" ({num(r.get('wall_tok_s'))})" if r.get("wall_tok_s") else ""
        ppl = num(r.get("ppl"), "{:.4f}")
        failed = f" failed: {o.error}" if o.error else ""
        out.append(f"| {label} | {ft} | {num(r.get('ppl_tok_s'))}{extra}{failed} | {ppl} |")
    out.append("")
    if not info.get("ppl_llama_bin"):
        return [*out, "llama-perplexity not run (no --llama-bin): no targets checked.", ""]
    for label, goal in (("perplexity: numpy dequantize-all", 1.0),
                        ("perplexity: numpy cpu as llama.cpp", 0.7)):  # fmt: skip
        for ft in ("Q8_0", "Q4_K_M"):
            ours, theirs = got.get((label, ft)), got.get((LLAMA_PERPLEXITY, ft))
            a = ours.result.get("ppl_tok_s") if ours and ours.result else None
            b = theirs.result.get("ppl_tok_s") if theirs and theirs.result else None
            x = a / b if a and b else None
            out.append(
                f"- {label}, {ft} >= {goal:g}x llama-perplexity: {num(a)} vs {num(b)} tok/s = "
                f"{num(x, '{:.2f}x')}: {verdict(x, goal)}"
            )
    return [*out, ""]


def find(table: list[Row], label: str, file: str) -> Row | None:
    return next((r for r in table if r["label"] == label and r["file"] == file), None)


def ratio(a: Row | None, b: Row | None, key: str) -> float | None:
    if a is None or b is None or a.get(key) is None or not b.get(key):
        return None
    return float(a[key]) / float(b[key])


def num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def table_md(table: list[Row]) -> list[str]:
    out = [
        "| setting | file | load s | prefill tok/s | teacher forcing tok/s | decode tok/s "
        "| peak RSS MB: generate / all | TF / llama.cpp | decode / llama.cpp "
        "| decode / transformers |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    hf = find(table, TRANSFORMERS, "F32")
    for r in table:
        llama = find(table, LLAMA_CPP, r["file"])
        peer = r["label"] not in (LLAMA_CPP, TRANSFORMERS)
        vs_hf = ratio(r, hf, "decode_tok_s") if r["label"] != TRANSFORMERS else None
        out.append(
            f"| {r['label']} | {r['file']} | {num(r.get('load_s'), '{:.2f}')} "
            f"| {num(r.get('prefill_tok_s'))} | {num(r.get('tf_tok_s'))} "
            f"| {num(r.get('decode_tok_s'))} | {num(r.get('generate_peak_rss_mb'), '{:.0f}')} / "
            f"{num(r.get('peak_rss_mb'), '{:.0f}')} "
            f"| {num(ratio(r, llama, 'tf_tok_s') if peer else None, '{:.2f}x')} "
            f"| {num(ratio(r, llama, 'decode_tok_s') if peer else None, '{:.2f}x')} "
            f"| {num(vs_hf, '{:.2f}x')} |"
        )
    return out


def verdict(value: float | None, goal: float, *, at_most: bool = False) -> str:
    if value is None:
        return "not measured"
    ok = value <= goal if at_most else value >= goal
    return "**met**" if ok else "**missed**"


def value(row: Row | None, key: str) -> float | None:
    return None if row is None else row.get(key)


def targets_md(table: list[Row], info: dict[str, Any]) -> list[str]:
    out = ["## Targets", ""]
    for label in CPU_ROWS:
        out.append(f"{label}:")
        out.append("")
        for ft in ("Q8_0", "Q4_K_M"):
            ours, llama = find(table, label, ft), find(table, LLAMA_CPP, ft)
            x = ratio(ours, llama, "decode_tok_s")
            out.append(
                f"- {ft} decode >= 0.5x llama.cpp: {num(value(ours, 'decode_tok_s'))} vs "
                f"{num(value(llama, 'decode_tok_s'))} tok/s = {num(x, '{:.2f}x')}: "
                f"{verdict(x, 0.5)}"
            )
        for ft in ("Q8_0", "Q4_K_M"):
            ours, llama = find(table, label, ft), find(table, LLAMA_CPP, ft)
            x = ratio(ours, llama, "tf_tok_s")
            pp = ours and llama and ours.get("tf_tok_s") and llama.get("prefill_tok_s")
            pp_x = ours["tf_tok_s"] / llama["prefill_tok_s"] if pp and ours and llama else None
            out.append(
                f"- {ft} teacher forcing ({info['tokens']} tokens) >= 1x llama.cpp with the "
                f"logits of every position: {num(value(ours, 'tf_tok_s'))} vs "
                f"{num(value(llama, 'tf_tok_s'))} tok/s = {num(x, '{:.2f}x')}: {verdict(x, 1.0)} "
                f"(against its last-logits prompt processing, "
                f"{num(value(llama, 'prefill_tok_s'))} tok/s: {num(pp_x, '{:.2f}x')})"
            )
        ours = find(table, label, "Q4_K_M")
        size = info["file_mb"]["Q4_K_M"]
        limit = 1.25 * size + 150
        for key, what in (("generate_peak_rss_mb", "generating"), ("peak_rss_mb", "in all")):
            rss = value(ours, key)
            out.append(
                f"- Q4_K_M peak RSS {what} <= 1.25 x {size:.0f} MB + 150 MB = {limit:.0f} MB: "
                f"{num(rss, '{:.0f}')} MB: {verdict(rss, limit, at_most=True)}"
            )
        out.append("")
    best: tuple[float, Row] | None = None
    for r in table:
        if r["file"] in ("Q8_0", "Q4_K_M") and r["label"] not in (LLAMA_CPP, TRANSFORMERS):
            x = ratio(r, find(table, LLAMA_CPP, r["file"]), "tf_tok_s")
            if x is not None and (best is None or x > best[0]):
                best = (x, r)
    if best is not None:
        x, r = best
        out.append(
            f"- Fastest teacher forcing of any qllama setting on a quantized file: {r['label']} "
            f"on {r['file']}, {r['tf_tok_s']:.1f} tok/s = {x:.2f}x llama.cpp: {verdict(x, 1.0)}"
        )
    hf = find(table, TRANSFORMERS, "F32")
    for ft in ("F32", "Q8_0", "Q4_K_M"):
        ours = find(table, "numpy dequantize-all", ft)
        x = ratio(ours, hf, "decode_tok_s")
        out.append(
            f"- numpy dequantize-all decode ({ft}) >= 1.5x transformers f32 eager: "
            f"{num(value(ours, 'decode_tok_s'))} vs {num(value(hf, 'decode_tok_s'))} tok/s = "
            f"{num(x, '{:.2f}x')}: {verdict(x, 1.5)}"
        )
    return out


def profile_md(table: list[Row]) -> list[str]:
    out = ["## Where the time goes (CPU arithmetic, numba kernels)", ""]
    for r in table:
        p = r.get("profile") if r["label"] in CPU_ROWS else None
        if not p:
            continue
        d, tf = p["decode"], p["tf"]
        rest = d["ms_per_token"] - d["matmul_ms"]
        tf_rest = tf["s"] - tf["matmul_s"]
        out.append(
            f"- {r['label']}, {r['file']}: decode {d['ms_per_token']:.1f} ms/token, of which "
            f"the quantized matmuls {d['matmul_ms']:.1f} ms and the rest of the forward "
            f"(norms, RoPE, attention, KV cache, Python) {rest:.1f} ms; teacher forcing "
            f"{tf['s']:.2f} s, of which matmuls {tf['matmul_s']:.2f} s, the rest {tf_rest:.2f} s."
        )
    return out


def observer_md(result: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """The forward pass's observer hook (issue 13): decoding with none and with a no-op one."""
    med = result["median_ms_per_step"]
    none, noop = med["none"], med["no-op observer"]
    rounds = len(result["rounds"]["none"])
    return [
        "## The observer hook",
        "",
        f"SmolLM2 Q8_0, CPU arithmetic (numba kernels), {info['decode_steps']} decode steps "
        f"after the prompt; {rounds} rounds alternating no observer and a no-op observer "
        "(`forward(..., observer=lambda name, value: None)`), the median of each round's "
        "median ms/step. Without an observer the hook's calls are skipped, so its cost is at "
        "most the no-op observer's.",
        "",
        "| observer | ms/step | ratio to none |",
        "|---|--:|--:|",
        f"| none | {none:.2f} | 1.000 |",
        f"| no-op | {noop:.2f} | {noop / none:.3f} |",
        "",
    ]


def write_report(
    path: Path, info: dict[str, Any], outcomes: dict[str, tuple[Config, Outcome]]
) -> None:
    # not at the top: bench.py imports this module, and its worker processes must not load
    # qllama before they measure its import (the llama.cpp worker runs without it)
    from qllama.atomic import atomic_write

    table, failed = rows(outcomes)
    m, v = info["machine"], info["versions"]
    load = info["load_before"], info["load_after"]
    lines = [
        "# Benchmarks",
        "",
        "Written by `nox -s bench` (`benchmarks/bench.py`); do not edit by hand.",
        "",
        f"{info['date']}. {m.get('cpu', '?')}, {m.get('cpus')} logical CPUs "
        f"({m.get('simd', '')}), {m.get('memory_gb', '?')} GB; {m['platform']}. "
        f"Every configuration ran in its own process, pinned to {info['threads']} CPUs, with "
        f"{info['threads']} threads in every pool (OpenMP, OpenBLAS, MKL, numba, torch, "
        f"llama.cpp `n_threads` and `n_threads_batch`). Load average (1 min) before / after: "
        f"{num(load[0] and load[0][0], '{:.2f}')} / {num(load[1] and load[1][0], '{:.2f}')}.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
    ]
    if info.get("isa"):
        lines += [
            f"**Instruction set: {info['isa'].upper()}** (`--isa {info['isa']}`): qllama's "
            "kernels compiled for this CPU without its AVX-512 features, llama.cpp built "
            "without AVX-512 (benchmarks/isa.py): what an AVX2-only build does on this "
            "hardware.",
            "",
        ]
    if info["tokens"]:  # the SmolLM2 section ran (not `--only scale`)
        lines += smollm2_md(table, info, outcomes)
    if info.get("scale"):
        lines += scale_md(info["scale"])
    if info["llama_note"]:
        lines += [f"llama.cpp skipped: {info['llama_note']}.", ""]
    if failed:
        lines += ["Failed configurations:", "", *[f"- {f}" for f in failed], ""]
    with atomic_write(path, "w") as f:
        f.write("\n".join(lines))


def smollm2_md(
    table: list[Row], info: dict[str, Any], outcomes: dict[str, tuple[Config, Outcome]]
) -> list[str]:
    """The SmolLM2 rows: the table, targets, profile, perplexity, observer and serving."""
    lines = [
        f"Tokens: the study's chat prompt ({info['prompt_len']} tokens) and "
        f"{info['tokens'] - info['prompt_len']} greedy tokens (qllama, F32 file, dequantize-all; "
        "end of turn ignored"
        + (
            f", first reached at new token {info['first_stop']}"
            if info["first_stop"] is not None
            else ""
        )
        + f"): {info['tokens']} tokens.",
        "",
        "- **load**: `qllama.load` (reading, checking, preparing the weights) or the peer's "
        "constructor. The first forward pass, which compiles (jax) or loads cached kernels "
        "(numba), is a warm-up and not timed. numba's kernels are compiled into its disk "
        "cache by a process of their own before any measurement.",
        f"- **prefill**: one forward pass over the {info['tokens']} tokens, logits of the last "
        "position (llama.cpp: `eval` with `logits_all=False`).",
        "- **teacher forcing**: the same pass with the logits of every position "
        "(`forward(ids, all_logits=True)`; transformers: `model(ids).logits`; llama.cpp: `eval` "
        "with `logits_all=True`). The teacher-forcing target compares with this llama.cpp "
        "number, which does the same work; the prefill column has its plain prompt processing.",
        f"- **decode**: prefill the prompt, then one token per step at the next position with "
        f"the KV cache; {info['decode_steps']} timed steps after 4 warm-up steps "
        "(the numpy oracle: 4 after 1).",
        f"- Medians of {info['repeats']} runs (the numpy oracle: 1). **peak RSS**: the "
        "process's VmHWM (file pages it touched count) after loading and generating (prefill "
        "of the prompt, decoding), then at the end, after teacher forcing, whose logits of "
        "every position take 337 x 49152 x 4 bytes = 66 MB (llama.cpp: its run without, then "
        "with `logits_all`).",
        "",
        "File sizes: " + ", ".join(f"{ft} {mb:.0f} MB" for ft, mb in info["file_mb"].items()) + ".",
        "",
        *table_md(table),
        "",
        *targets_md(table, info),
        "",
        *profile_md(table),
        "",
        *perplexity_md(outcomes, info),
    ]
    imports = [
        (r["label"], r.get("import_rss_mb"))
        for r in table
        if r["file"] == "Q8_0" and r["label"].startswith("numpy cpu")
    ]
    if imports:
        lines += [
            "Import cost (RSS after importing qllama, and numba with the kernels where used): "
            + "; ".join(f"{label}: {num(mb, '{:.0f}')} MB" for label, mb in imports)
            + ".",
            "",
        ]
    if info.get("observer"):
        lines += observer_md(info["observer"], info)
    if info.get("serving"):
        serving = info["serving"]
        lines += serving_md(serving["results"], serving["info"])
    return lines
