"""Measuring drift: comparisons with a reference, metrics, layer traces, attribution,
perplexity and its KL-divergence bases, transformers references, corpora."""
