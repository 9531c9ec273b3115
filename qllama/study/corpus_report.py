"""The report's corpus section: the ``corpus`` measure (:mod:`qllama.study.measures`) of every
cell that has it, as llama-perplexity's numbers, one row per file and arithmetic.

The measure does not depend on the cell's prompt, so a study asks for it in the cells of one
prompt; the section stands on its own, before the prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qllama.study.collect import PromptResults
from qllama.study.results import Corpus

FLOORS = {
    "f32": "float32 logits: no resolution floor",
    "llama": "llama.cpp's uint16 log-probs: a KLD below about 1e-4 is not resolved",
}
Table = Callable[[Sequence[str], Sequence[Sequence[Any]]], list[str]]


def corpus_cells(prompts: Mapping[str, PromptResults]) -> dict[str, Corpus]:
    """``variant-setting`` -> its corpus result, from whichever prompt's cells hold one."""
    out = {}
    for entry in prompts.values():
        for label, c in entry.cells.items():
            if "corpus" in c.measures:
                out[label] = c.measures.corpus
    return out


def section(
    prompts: Mapping[str, PromptResults], options: Mapping[str, Any], table: Table
) -> list[str]:
    """PPL with its ±, the KL statistics, same top and RMS Δp against the base."""
    cells = corpus_cells(prompts)
    if not cells:
        return []
    first = next(iter(cells.values()))
    rows = [
        [
            label,
            f"{m.ppl:.4f} ± {m.ppl_unc:.4f}",
            f"{m.kl.ln_ppl_ratio:+.5f} ± {m.kl.ln_ppl_ratio_unc:.5f}",
            f"{m.kl.mean_kld:.3e} ± {m.kl.mean_kld_unc:.1e}",
            f"{m.kl.kld['median']:.2e}",
            f"{m.kl.kld['99%']:.2e}",
            f"{m.kl.kld['max']:.3g}",
            f"{100 * m.kl.same_top:.2f} ± {100 * m.kl.same_top_unc:.2f}%",
            f"{100 * m.kl.rms_dp:.3f}%",
        ]
        for label, m in cells.items()
    ]
    base = (
        "transformers f32 (eager, CPU)"
        if options.get("reference", "transformers") == "transformers"
        else "qllama's dequantize-all"
    )
    return [
        "## Corpus: perplexity and KL divergence\n",
        f"`{options.get('corpus', 'botchan')}` (docs/perplexity.md), {first.windows} windows "
        f"of {first.n_ctx} tokens ({first.windows * first.n_ctx} tokens), "
        f"{first.tokens} scored positions (the second half of each window), as "
        f"llama-perplexity computes them, against the base {base} on the F32 file, stored as "
        f"`{first.base_format}` ({FLOORS.get(first.base_format, '')}). PPL(base) = "
        f"{first.kl.ppl_ref:.4f}. ± is one standard error, llama-perplexity's.\n",
        *table(
            [
                "cell",
                "PPL",
                "ln(PPL/PPL(base))",
                "mean KLD",
                "median KLD",
                "99% KLD",
                "max KLD",
                "same top",
                "RMS Δp",
            ],
            rows,
        ),
    ]
