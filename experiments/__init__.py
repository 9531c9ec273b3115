"""The study: SmolLM2-135M-Instruct, Q8_0 and Q4_K_M against transformers f32.

See docs/experiments.md.
"""
