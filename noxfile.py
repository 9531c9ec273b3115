"""Sessions: tests, tests-avx2, lint, reference, experiments, study-peers, peers, bench, fuzz, hf.

CI (``.ci/run``) runs ``nox -s tests``, then ``nox -s experiments`` on two of the study's
prompts; ``nox -l`` lists everything.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

# torch 2.13.0 is the CPU build on this project's machines; a looser pin pulls a CUDA
# build of several GB. The package itself asks only for "torch>=2.2" so a Mac gets MPS.
TORCH = "torch==2.13.0"
# The reference's versions: transformers changes what gguf_file= runs between releases.
REFERENCE = ["transformers==5.24.0", "accelerate==1.15.0", "gguf==0.19.0"]
# the linters at the versions the code is clean under (a new release finds new things)
LINTERS = ["ruff==0.17.6", "mypy==2.4.1"]
# the harness tests/test_serve_lm_eval.py drives qllama serve with (its API model)
LM_EVAL = "lm-eval[api]==0.4.13"
# what llama-cpp-python's own server needs beside the wheel (the serving benchmark's peer)
LLAMA_CPP_SERVER = [
    "sse-starlette>=1.6.1",
    "starlette-context>=0.3.6,<0.4",
    "pydantic-settings>=2.0.1",
]


# The tests in one process per CPU, at most 4 (pytest-xdist). The kernel tests' two files go
# by weight type (their xdist_group, split in tests/conftest.py): one process compiles a type's
# kernels, instead of each process all of them.
PARALLEL = ["-n", "logical", "--maxprocesses", "4", "--dist", "loadgroup"]


def install_tests(session: nox.Session) -> None:
    """What the test suite needs, qllama as a wheel (not editable): pytest does not put the
    repository on sys.path, so the tests exercise what `pip install .` gives."""
    session.install(TORCH, *REFERENCE)
    # plot: the trace's figure; serve, hf, hf-eval and lm-eval: the server and adapter tests;
    # dask: the study's cluster test
    session.install(".[dev,torch,jax,reference,plot,serve,hf,hf-eval,dask]", LM_EVAL)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (slow tests excluded; `nox -s tests -- -m slow` runs them)."""
    install_tests(session)
    # first, so that arguments given after `--` (`-n 0`, say) override them
    session.run("pytest", *PARALLEL, *(session.posargs or ["-m", "not slow"]))


@nox.session(name="tests-avx2")
def tests_avx2(session: nox.Session) -> None:
    """The test suite under an AVX2-only machine's code paths, on an AVX-512 host: numba's
    kernels, OpenBLAS, numpy's loops, torch and XLA told to stop at AVX2 (tools/isa_env.py)."""
    install_tests(session)
    out = session.run("python", "tools/isa_env.py", "avx2", silent=True)
    env = dict(line.split("=", 1) for line in str(out).strip().splitlines())
    session.log("AVX2 code paths: " + ", ".join(sorted(env)))
    session.run("pytest", *PARALLEL, *(session.posargs or ["-m", "not slow"]), env=env)


# qllama.hf is tested at both ends of the transformers range it supports
# (qllama.hf.TRANSFORMERS_RANGE: the oldest 4.57 and the newest release), and at 5.0.0, where
# the cache API it implements changed most. `nox -s tests` runs its tests too, with the
# transformers of REFERENCE.
HF_TRANSFORMERS = ["4.57.6", "5.0.0", "5.25.0"]
HF_TESTS = [
    "tests/test_hf.py",
    "tests/test_hf_tokenizer.py",
    "tests/test_hf_lm_eval.py",
    "tests/test_hf_dropin.py",
]


@nox.session
@nox.parametrize("transformers", HF_TRANSFORMERS)
def hf(session: nox.Session, transformers: str) -> None:
    """The transformers integration's tests with one transformers release of its range."""
    session.install(TORCH, f"transformers=={transformers}", ".[dev,hf,hf-eval,reference]")
    args = session.posargs or ["-m", "not slow"]
    session.run("pytest", *HF_TESTS, *args)


SEED = "experiments/seed.toml"  # the seed study (docs/experiments.md)


@nox.session
def reference(session: nox.Session) -> None:
    """The seed study's transformers f32 references (each prompt, and the recomputation of
    the reference-avx2 draw), cached in results/references/ with their provenance."""
    session.install(TORCH, *REFERENCE)
    session.install("-e", ".[reference]")
    session.run("qllama", "study", "run", SEED, "--references-only", *session.posargs)


@nox.session(requires=["reference"])
def experiments(session: nox.Session) -> None:
    """The seed study: every cell in local processes, docs/results.md, the findings asserted.

    `-- --cells 'cpu-cache/*'` runs some cells, `-- --report-only` rebuilds the report,
    `-- --executor dask --scheduler ADDRESS` runs on a cluster (docs/studies.md).
    """
    # reference: transformers runs the F32 file in the cells too (the layer trace's hooks,
    # the corpus base), at the reference's versions
    session.install(TORCH, *REFERENCE)
    session.install("-e", ".[torch,jax,plot,reference]")
    session.run("qllama", "study", "run", SEED, "--docs", "docs", *session.posargs)


@nox.session
def ladder(session: nox.Session) -> None:
    """SmolLM2's quant ladder (`qllama ladder`, docs/choosing.md): every file type qllama's
    quantizer makes, with and without an importance matrix, over the corpus and two prompts,
    under the CPU arithmetic (its band: the avx2 and sse draws) and dequantize-all; into
    docs/ladder/. Arguments after -- go to qllama ladder (CI: three types, four windows)."""
    session.install("-e", ".[plot]")
    args = ["smollm2-135m-instruct", "--results", "results", "--out", "docs/ladder"]
    session.run("qllama", "ladder", *args, *session.posargs)


CONTROL_TYPES = "Q8_0,Q6_K,Q5_K_M,Q5_1,Q5_0,Q4_K_M,Q4_1,Q4_0,IQ4_XS,Q3_K_M"


@nox.session
def controls(session: nox.Session) -> None:
    """How far SmolLM2's ladder carries (docs/choosing.md): one ladder (ten types, no
    importance matrix, 8 windows) on SmolLM2 and on its two controls, its weights dithered off
    their Q4_1 grid and Gaussian weights of its shape (qllama.study.controls); into
    docs/ladder-controls/. Arguments after -- go to every qllama ladder."""
    session.install("-e", ".[plot]")
    common = ["--types", CONTROL_TYPES, "--imatrix-corpus", "none", "--draw", "none"]
    common += ["--chunks", "8", "--results", "results", *session.posargs]
    for control in ("none", "dither", "gaussian"):
        which = [] if control == "none" else ["--control", control]
        out = ["--out", f"docs/ladder-controls/{'smollm2' if control == 'none' else control}"]
        session.run("qllama", "ladder", "smollm2-135m-instruct", *which, *out, *common)


MOE = "experiments/moe.toml"
MOE_FILE = "results/moe/smollm2-moe.F32.gguf"  # the path experiments/moe.toml reads


@nox.session
def moe(session: nox.Session) -> None:
    """Where routing meets quantization (docs/moe.md): SmolLM2 upcycled into a mixture of 4
    experts, 2 per token (qllama moefy, seeded: the same file every time), then the study
    experiments/moe.toml (its F32, Q8_0 and Q4_K_M files against qllama's F32 run: routing
    agreement, the error with the F32 file's experts forced, which experts carry the weight
    error, perplexity over 4 windows) into docs/moe/, its findings asserted. Arguments after
    -- go to qllama study run."""
    session.install("-e", ".[plot]")
    moefy = ["--mode", "upcycle", "--experts", "4", "--k", "2"]
    session.run("qllama", "moefy", "smollm2-135m-instruct", MOE_FILE, *moefy)
    session.run("qllama", "study", "run", MOE, "--docs", "docs/moe", *session.posargs)


@nox.session
def recipe(session: nox.Session) -> None:
    """A recipe at a bits-per-weight budget for SmolLM2 (`qllama recipe`, docs/choosing.md):
    the sensitivities measured (cached), the file written, and compared on held-out windows
    with the stock mixtures, into docs/recipe/. Arguments after -- go to qllama recipe (they
    override the defaults here; CI: a small recipe, two candidate types, one band)."""
    session.install("-e", ".[plot]")
    args = ["smollm2-135m-instruct", "--target-bpw", "5.5", "-o", "recipe.gguf", "--compare"]
    args += ["--results", "results", "--report", "docs/recipe"]
    session.run("qllama", "recipe", *args, *session.posargs)


# llama.cpp for the peer sessions: built from the llama-cpp-python sdist for the CPU it runs on
# (AVX-512 only where /proc/cpuinfo has avx512f, never AMX), cached per flags
# (tools/llama_cpp_build.py).
LLAMA_CPP_BUILD = "tools/llama_cpp_build.py"


def llama_cpp_wheel(session: nox.Session) -> str:
    """Build (once per CPU flags) and return the llama-cpp-python wheel."""
    out = session.run("python", LLAMA_CPP_BUILD, "wheel", silent=True)
    return str(out).strip().splitlines()[-1]


def llama_cpp_tools(session: nox.Session) -> str:
    """Build (once per CPU flags) and return the bin folder of llama.cpp's tools."""
    out = session.run("python", LLAMA_CPP_BUILD, "tools", silent=True)
    return str(out).strip().splitlines()[-1]


@nox.session
def peers(session: nox.Session) -> None:
    """Compare with llama.cpp: quantizer bytes, tokenizer ids (builds llama.cpp, ~15 min once)."""
    session.install(TORCH, *REFERENCE)
    session.install(".[dev,torch,reference]")
    session.install(llama_cpp_wheel(session))
    bin_dir = llama_cpp_tools(session)
    # the committed ggml vectors of the issue-11 types are what this ggml writes
    session.run("python", "tests/data/make_vectors.py", "--check")
    session.run("pytest", "tests/peers", f"--llama-bin={bin_dir}", *session.posargs)


@nox.session(name="study-peers", requires=["reference"])
def study_peers(session: nox.Session) -> None:
    """The seed study with llama.cpp's own CPU run as one more draw (builds llama-cpp-python)."""
    session.install(TORCH, *REFERENCE)
    session.install("-e", ".[torch,jax,plot,reference]")
    session.install(llama_cpp_wheel(session))
    session.run(
        "qllama", "study", "run", SEED, "--draw", "llama.cpp", "--docs", "docs", *session.posargs
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (check and format) and mypy (CI runs it; .pre-commit-config.yaml too).

    mypy checks qllama as the wheel installs it, from outside the checkout: there the top-level
    backends/ folder is qllama.backends, the one name that imports and mypy's settings use.
    """
    session.install(TORCH, *REFERENCE, *LINTERS)
    # the optional modules' libraries too: without them their types are Any, and mypy's
    # verdict (unused ignores, say) would depend on what a machine happens to have
    session.install(".[dev,torch,jax,reference,hf,serve,dask,plot]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    config = str(Path(__file__).resolve().parent / "pyproject.toml")
    with session.chdir(session.create_tmp()):
        session.run("mypy", "--config-file", config, "-p", "qllama")


@nox.session
def fuzz(session: nox.Session) -> None:
    """Mutation fuzzing of the GGUF loader, bounded: `nox -s fuzz -- --cases N --seconds S`.

    Prints the figures (cases, error classes, escapes, peak memory); exits 1 on an escape.
    `-- --out DIR` also writes summary.json and the escaping inputs.
    """
    session.install(".[dev]")
    session.run("python", "fuzz/gguf_mutations.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Speed and memory against transformers and llama.cpp, 2 threads: writes docs/bench.md.

    Builds llama-cpp-python (~6 min; skipped with a note in the report if it fails), then
    runs every configuration in its own process (~30 min on 2 cores), then the section
    "At scale" (~20 min more: 135M and a 1B-shaped synthetic llama written once into the
    cache, decode time against context length; `-- --scale-3b` adds a 3B shape, ~5 min more;
    `-- --no-scale` skips it, `-- --only scale` runs it alone). Run it on a quiet machine: the
    report records the load average. `-- --quick` or `-- --only TEXT` for less. `-- --isa avx2
    --only scale --out docs/bench-avx2.md` measures both sides built for AVX2 on an AVX-512
    host (benchmarks/isa.py; builds llama.cpp's libraries for AVX2 once, ~15 min). A full run
    (no arguments) then writes docs/bench-types.md: decode per weight type at the 1B shape
    (benchmarks/per_type.py; ~1 min a type to write its file once, then its two decodes), and
    docs/bench-moe.md: a ~1B mixture of experts against llama.cpp (benchmarks/moe.py, ~30 min).
    """
    session.install(TORCH, *REFERENCE)
    session.install(".[torch,jax,reference,serve]", "openai>=1.40", "psutil")
    note = []
    try:
        session.install(llama_cpp_wheel(session), *LLAMA_CPP_SERVER)
    except nox.command.CommandFailed:
        note = ["--llama-note", f"llama-cpp-python did not build ({LLAMA_CPP_BUILD} wheel)"]
    no_llama = list(note)  # per_type.py's one option of these
    try:  # llama-perplexity, for the corpus perplexity rows
        note += ["--llama-bin", llama_cpp_tools(session)]
    except nox.command.CommandFailed:
        pass
    session.run("python", "benchmarks/bench.py", *note, *session.posargs)
    if not session.posargs:  # a full run: also decode per weight type, docs/bench-types.md
        session.run("python", "benchmarks/per_type.py", *no_llama)
        if "--llama-bin" in note:  # the mixture of experts against llama.cpp's tools build
            at = note.index("--llama-bin")
            session.run("python", "benchmarks/moe.py", *note[at : at + 2])
