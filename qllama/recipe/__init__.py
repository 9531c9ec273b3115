"""Recipes at a budget: each tensor group's type chosen to minimise the measured KL divergence
at a bits-per-weight budget (``qllama recipe``), written as llama-quantize overrides."""
