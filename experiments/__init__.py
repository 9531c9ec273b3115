"""The seed study: SmolLM2-135M-Instruct, Q8_0 and Q4_K_M against transformers f32, on seven
prompts, with the CPU arithmetic's noise band. The declaration is experiments/seed.toml, its
findings experiments/findings.py; ``nox -s experiments`` runs it (docs/experiments.md).
"""
