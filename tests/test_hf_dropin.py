"""qllama.hf's drop-in names and opt-in: transformers users' code, unchanged but for the path.

A transformers-style script (tests/data/hf_script.py: ``AutoModelForCausalLM``,
``AutoTokenizer``, ``TextIteratorStreamer`` in a thread, ``pipeline`` with
``return_full_text=False`` and a batch, chat messages) runs in a subprocess twice: with its
import line changed to import the three names from ``qllama.hf``, and unmodified under ``python -m
qllama.hf``. Its tokens must be qllama's own greedy ones. The rest checks the routing (GGUF
files to qllama, anything else to transformers untouched), the keywords such scripts pass,
the errors for files that are not GGUF, install/uninstall, and the version check.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_architectures import FAMILIES  # noqa: E402

import qllama.hf  # noqa: E402
from qllama.errors import (  # noqa: E402
    GGUFMagicError,
    GGUFOpenError,
    GGUFTruncatedError,
    UnsupportedOptionError,
)
from qllama.hf import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    QllamaForCausalLM,
    QllamaTokenizer,
    auto,
    compat,
    loading,
    pipeline,
)
from qllama.runtime.generation import Sampler, generate_ids  # noqa: E402
from qllama.synthetic import TinyConfig, write_tiny  # noqa: E402

SCRIPT = Path(__file__).parent / "data" / "hf_script.py"
HUB_ID = '"Qwen/Qwen2-7B"'  # what the script loads as written
IMPORT = (
    "from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer, pipeline\n"
)
# the same line, for the drop-in names (the streamer stays transformers')
DROP_IN = (
    "from transformers import TextIteratorStreamer; "
    "from qllama.hf import AutoModelForCausalLM, AutoTokenizer, pipeline\n"
)
# a Q8_0 llama whose context is the script's n_ctx: the CPU arithmetic quantizes activations
TINY = TinyConfig(weight_type="Q8_0", scale=0.3, n_ctx=4096)
PROMPTS = ["The capital of France is", "Hi"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
N_NEW = 8
# the keywords the script passes
SCRIPT_KWARGS: dict[str, Any] = dict(
    device_map="auto", torch_dtype=torch.float16, n_ctx=4096, n_threads=8, n_gpu_layers=100
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dropin") / "tiny.Q8_0.gguf"
    write_tiny(path, TINY)
    return path


@pytest.fixture(scope="module")
def model(tiny: Path) -> QllamaForCausalLM:
    m: QllamaForCausalLM = AutoModelForCausalLM.from_pretrained(tiny, **SCRIPT_KWARGS)
    return m


@pytest.fixture(scope="module")
def tok(tiny: Path) -> QllamaTokenizer:
    t: QllamaTokenizer = AutoTokenizer.from_pretrained(tiny)
    return t


@pytest.fixture
def patched() -> Iterator[None]:
    """install() for one test; uninstall() after, whatever happens."""
    qllama.hf.install()
    yield
    qllama.hf.uninstall()


def raw_greedy(m: QllamaForCausalLM, ids: list[int], n: int = N_NEW) -> list[int]:
    """qllama's own decode loop (prefill, then one token per step), to its stop tokens."""
    stops = sorted(m.llm.tokenizer.stop_ids)
    return list(generate_ids(m.llm, ids, max_new_tokens=n, sampler=Sampler(), stop_ids=stops))


def expected(m: QllamaForCausalLM, tok: QllamaTokenizer) -> dict[str, Any]:
    """What the script must print: qllama's greedy tokens and their text."""
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    alone = [raw_greedy(m, ids) for ids in prompts]

    def text(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=True))

    return {
        "class": "QllamaForCausalLM",
        "device": "cpu",
        "parameters": 1,
        "greedy": alone[0],
        "batch": alone,
        "streamed": text(alone[0]),
        "pipeline": [text(a) for a in alone],
        "chat": text(raw_greedy(m, m.llm.apply_chat_template(CHAT))),
    }


def check_batch(rows: list[list[int]], alone: list[list[int]], pad: int) -> None:
    """Each row of a generated batch is its prompt's greedy tokens, then padding."""
    for row, one in zip(rows, alone, strict=True):
        assert row[: len(one)] == one
        assert set(row[len(one) :]) <= {pad}


# --- the script, unmodified but for its path ------------------------------------------------------


def run_script(tmp_path: Path, text: str, *prefix: str) -> dict[str, Any]:
    script = tmp_path / "user_script.py"
    script.write_text(text)
    done = subprocess.run(
        [sys.executable, *prefix, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("how", ["drop-in import", "python -m qllama.hf"])
def test_a_transformers_script_runs_unchanged_but_for_the_path(
    how: str, tiny: Path, model: QllamaForCausalLM, tok: QllamaTokenizer, tmp_path: Path
) -> None:
    source = SCRIPT.read_text()
    assert source.count(HUB_ID) == 1 and source.count(IMPORT) == 1
    text = source.replace(HUB_ID, json.dumps(str(tiny)))
    if how == "drop-in import":
        got = run_script(tmp_path, text.replace(IMPORT, DROP_IN))
    else:
        got = run_script(tmp_path, text, "-m", "qllama.hf")
    want = expected(model, tok)
    check_batch(got.pop("batch"), want.pop("batch"), tok.pad_token_id)
    assert got == want


def test_the_script_as_written_is_transformers_own(tiny: Path, tmp_path: Path) -> None:
    """Without the opt-in, transformers' names are untouched: they cannot read a GGUF path."""
    with pytest.raises(Exception) as caught:
        transformers.AutoModelForCausalLM.from_pretrained(str(tiny))
    assert not isinstance(caught.value, qllama.errors.QllamaError)


def test_main_without_a_script_prints_its_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "qllama.hf"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2 and "python -m qllama.hf script.py" in done.stderr


# --- routing: GGUF files to qllama, the rest to transformers untouched -------------------------


def test_gguf_targets(tiny: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(tiny.read_bytes())
    (tmp_path / "config.json").write_text("{}")
    assert loading.gguf_target(str(tiny)) == str(tiny)
    assert loading.gguf_target(tiny) == str(tiny)
    assert loading.gguf_target(tmp_path / "absent.GGUF") == str(tmp_path / "absent.GGUF")
    assert loading.gguf_target(renamed) == str(renamed)  # the magic, whatever the name
    assert loading.gguf_target(tiny.parent, tiny.name) == str(tiny)
    assert (
        loading.gguf_target("org/repo-GGUF", "m.Q4_K_M.gguf") == "hub:org/repo-GGUF:m.Q4_K_M.gguf"
    )
    assert loading.gguf_target("Qwen/Qwen2-7B") is None
    assert loading.gguf_target(str(tmp_path)) is None  # a folder: transformers'
    assert loading.gguf_target(tmp_path / "config.json") is None
    assert loading.gguf_target(None) is None


class Recorder:
    """Stands in for one of transformers' originals: records the call it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((args, kwargs))
        return "transformers"


@pytest.mark.parametrize("name", ["model", "tokenizer", "pipeline"])
def test_anything_else_goes_to_transformers_untouched(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = Recorder()
    kwargs = dict(device_map="auto", revision="main", whatever=1)
    if name == "pipeline":
        monkeypatch.setitem(auto.ORIGINALS, "pipeline", record)
        assert pipeline("text-generation", model="Qwen/Qwen2-7B", **kwargs) == "transformers"
        assert record.calls == [((), dict(task="text-generation", model="Qwen/Qwen2-7B", **kwargs))]
        return
    key, owner = {
        "model": ("AutoModelForCausalLM.from_pretrained", AutoModelForCausalLM),
        "tokenizer": ("AutoTokenizer.from_pretrained", AutoTokenizer),
    }[name]
    monkeypatch.setitem(auto.ORIGINALS, key, classmethod(record))
    assert owner.from_pretrained("Qwen/Qwen2-7B", 3, **kwargs) == "transformers"
    ((args, got),) = record.calls
    assert args[1:] == ("Qwen/Qwen2-7B", 3) and got == kwargs
    assert args[0] is getattr(transformers, owner.__name__)  # transformers' class, not ours


def test_drop_in_names_keep_transformers_signatures() -> None:
    import inspect

    assert inspect.signature(pipeline) == inspect.signature(transformers.pipelines.pipeline)
    assert issubclass(AutoModelForCausalLM, transformers.AutoModelForCausalLM)
    assert issubclass(AutoTokenizer, transformers.AutoTokenizer)


def test_a_hub_repository_with_gguf_file(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    asked: list[dict[str, Any]] = []

    def download(**kwargs: Any) -> str:
        asked.append(kwargs)
        return str(tiny)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    m = AutoModelForCausalLM.from_pretrained("org/tiny-GGUF", gguf_file=tiny.name, revision="v1")
    assert isinstance(m, QllamaForCausalLM) and m.config.gguf_path == str(tiny)
    assert asked == [dict(repo_id="org/tiny-GGUF", filename=tiny.name, revision="v1")]


# --- files that are not GGUF get qllama's errors ------------------------------------------------


@pytest.fixture(scope="module")
def broken(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("broken")
    renamed = folder / "renamed-safetensors.gguf"
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    renamed.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    truncated = folder / "truncated.gguf"
    truncated.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    return {"renamed": renamed, "truncated": truncated, "absent": folder / "absent.gguf"}


ERRORS = {"renamed": GGUFMagicError, "truncated": GGUFTruncatedError, "absent": GGUFOpenError}
LOADERS = {
    "AutoModelForCausalLM": lambda p: AutoModelForCausalLM.from_pretrained(p, device_map="auto"),
    "folder+gguf_file": lambda p: AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name),
    "AutoTokenizer": lambda p: AutoTokenizer.from_pretrained(p),
    "pipeline": lambda p: pipeline("text-generation", model=str(p)),
    "transformers, installed": lambda p: transformers.AutoModelForCausalLM.from_pretrained(p),
    "transformers.pipeline, installed": lambda p: transformers.pipeline(model=str(p)),
}


@contextlib.contextmanager
def installed_if(on: bool) -> Iterator[None]:
    """install() around the block when ``on``."""
    if on:
        qllama.hf.install()
    try:
        yield
    finally:
        if on:
            qllama.hf.uninstall()


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", ERRORS)
def test_files_that_are_not_gguf_get_qllamas_error(
    case: str, loader: str, broken: dict[str, Path]
) -> None:
    with installed_if(loader.endswith("installed")), pytest.raises(ERRORS[case]):
        LOADERS[loader](broken[case])


# --- the keywords such scripts pass --------------------------------------------------------------


def plan(tiny: Path, **kwargs: Any) -> loading.LoadPlan:
    return loading.plan(kwargs, tiny)


def test_the_scripts_keywords_are_mapped_with_notes(model: QllamaForCausalLM) -> None:
    notes = " | ".join(model.load_notes)
    assert "torch_dtype=float16: the weights stay as the file stores them" in notes
    assert "device_map='auto': cpu" in notes and "n_gpu_layers=100" in notes
    assert "n_threads=8" in notes
    assert model.llm.n_ctx == 4096 and model.config.max_position_embeddings == 4096
    assert model.llm.backend.name == "numpy" and model.llm.backend.activations == "q8"
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    assert sum(p.numel() for p in model.parameters()) == 1  # no float copy of the weights


@pytest.mark.parametrize(
    ("kwargs", "options"),
    [
        ({}, {}),
        ({"device_map": "cpu"}, {}),
        ({"device_map": {"": "cpu"}}, {}),
        ({"device_map": {"model": "cpu", "lm_head": "cpu"}}, {}),
        ({"device_map": -1}, {}),
        ({"device_map": "cpu", "backend": "torch"}, {"backend": "torch", "device": "cpu"}),
        ({"device_map": "auto", "backend": "numpy"}, {"backend": "numpy", "device": "cpu"}),
        ({"n_gpu_layers": 0}, {}),
        ({"n_ctx": 64}, {"n_ctx": 64}),
        ({"n_threads": 1}, {"threads": 1}),
        ({"dtype": "bfloat16", "torch_dtype": torch.bfloat16}, {}),
        ({"torch_dtype": "auto", "trust_remote_code": True, "low_vram": True}, {}),
        ({"low_cpu_mem_usage": True}, {}),
        (
            {"backend": "numpy", "activations": "f32", "dequantize_all": True},
            {"backend": "numpy", "activations": "f32", "dequantize_all": True},
        ),
        ({"kv_precision": "f16"}, {"kv_precision": "f16"}),
    ],
)
def test_keywords_become_qllama_load_options(
    tiny: Path, kwargs: dict[str, Any], options: dict[str, Any]
) -> None:
    assert plan(tiny, **kwargs).options == options


@pytest.mark.parametrize(
    ("found", "backend", "device"),
    [(("cuda", "cpu"), "torch", "cuda"), (("mps", "cpu"), "torch", "mps"), (("cpu",), None, None)],
)
def test_device_map_auto_picks_cuda_then_mps_then_cpu(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, found: tuple[str, ...], backend: Any, device: Any
) -> None:
    monkeypatch.setattr(loading, "_torch_devices", lambda: found)
    for kwargs in ({"device_map": "auto"}, {"n_gpu_layers": -1}, {"n_gpu_layers": 100}):
        got = plan(tiny, **kwargs)
        assert (got.options.get("backend"), got.options.get("device")) == (backend, device)
    cuda = plan(tiny, device_map="cuda:1")
    assert cuda.options == {"backend": "torch", "device": "cuda:1"}
    assert plan(tiny, device_map=0).options == {"backend": "torch", "device": "cuda:0"}
    assert plan(tiny, device_map="auto", n_threads=2, backend="torch").torch_threads == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"quantization_config": {}},
            r"does not take \['quantization_config'\]; it takes .*device_map",
        ),
        ({"device_map": {"a": "cpu", "b": "cuda:0"}}, "splits the model across"),
        ({"device_map": "balanced"}, "spreads the layers"),
        ({"device_map": "sequential"}, "spreads the layers"),
        ({"device_map": {"a": "disk"}}, "disk"),
        ({"n_gpu_layers": 1}, "n_gpu_layers=1 of the file's 2 layers"),
        ({"torch_dtype": torch.int8}, "torch_dtype=int8"),
        ({"torch_dtype": torch.float64}, "torch_dtype=float64"),
        ({"torch_dtype": "float16", "dtype": "bfloat16"}, "disagree"),
        ({"device_map": "cpu", "device": "cuda"}, "disagree"),
        ({"n_threads": 2, "backend": "jax"}, "jax backend has no thread count"),
    ],
)
def test_keywords_refused_with_the_reason(tiny: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedOptionError, match=message):
        plan(tiny, **kwargs)


def test_an_unknown_keyword_is_never_dropped(tiny: Path) -> None:
    with pytest.raises(UnsupportedOptionError, match="attn_implementation"):
        AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="sdpa")
    with pytest.raises(UnsupportedOptionError, match="add_prefix_space.*padding_side"):
        AutoTokenizer.from_pretrained(tiny, add_prefix_space=True)
    with pytest.raises(UnsupportedOptionError, match="no \\['config'\\]"):
        pipeline("text-generation", model=str(tiny), config="x")
    with pytest.raises(UnsupportedOptionError, match="'summarization'"):
        pipeline("summarization", model=str(tiny))


@pytest.mark.parametrize(
    ("options", "check"),
    [
        ({"backend": "torch"}, lambda llm: llm.backend.name == "torch"),
        ({"dequantize_all": True}, lambda llm: llm.backend.dequantize_all),
        ({"activations": "f32"}, lambda llm: llm.backend.activations == "f32"),
    ],
)
def test_a_backend_option_chooses_the_arithmetic(
    tiny: Path, tok: QllamaTokenizer, options: dict[str, Any], check: Any
) -> None:
    m = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float16, **options)
    assert check(m.llm)
    ids = tok(PROMPTS[0], return_tensors="pt").to(m.device)
    out = m.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out[0, ids["input_ids"].shape[1] :].tolist() == raw_greedy(
        m, ids["input_ids"][0].tolist(), 4
    )


def test_the_tokenizer_is_qllamas(tiny: Path, tok: QllamaTokenizer) -> None:
    assert isinstance(tok, QllamaTokenizer)
    assert tok.model_max_length == 4096 and tok.name_or_path == str(tiny)
    assert tok.padding_side == "left"
    right = AutoTokenizer.from_pretrained(tiny.parent, gguf_file=tiny.name, padding_side="right")
    assert right.padding_side == "right"
    assert right(PROMPTS[0])["input_ids"] == tok(PROMPTS[0])["input_ids"]


# --- the rest of such scripts -------------------------------------------------------------------


def test_generate_greedy_flags_device_and_eos_lists(
    model: QllamaForCausalLM, tok: QllamaTokenizer
) -> None:
    inputs = tok(PROMPTS[0], return_tensors="pt").to(model.device)
    ids = inputs["input_ids"][0].tolist()
    want = raw_greedy(model, ids)
    assert model.to(model.device) is model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers notes temperature unused when greedy
        out = model.generate(
            **inputs, do_sample=False, temperature=0.0, top_p=1.0, max_new_tokens=N_NEW
        )
    assert out[0, len(ids) :].tolist() == want
    stop = [want[2], tok.eos_token_id]
    out = model.generate(**inputs, max_new_tokens=N_NEW, do_sample=False, eos_token_id=stop)
    assert out[0, len(ids) :].tolist() == want[: want.index(want[2]) + 1]


def test_left_padded_batch_and_pipeline_batches(
    model: QllamaForCausalLM, tok: QllamaTokenizer, tiny: Path
) -> None:
    alone = [raw_greedy(model, tok(p)["input_ids"]) for p in PROMPTS]
    batch = tok(PROMPTS, return_tensors="pt", padding=True).to(model.device)
    assert batch["attention_mask"][1, 0] == 0  # left padding
    out = model.generate(**batch, max_new_tokens=N_NEW, do_sample=False)
    check_batch(out[:, batch["input_ids"].shape[1] :].tolist(), alone, tok.pad_token_id)
    pipe = pipeline("text-generation", model=model)  # a loaded model: its own tokenizer
    got = pipe(PROMPTS, batch_size=2, max_new_tokens=N_NEW, do_sample=False, return_full_text=False)
    assert [g[0]["generated_text"] for g in got] == [
        tok.decode(a, skip_special_tokens=True) for a in alone
    ]


def test_streamer_in_a_thread(model: QllamaForCausalLM, tok: QllamaTokenizer) -> None:
    inputs = tok(PROMPTS[0], return_tensors="pt")
    streamer = transformers.TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    job = threading.Thread(
        target=model.generate,
        kwargs=dict(**inputs, streamer=streamer, max_new_tokens=N_NEW, do_sample=False),
    )
    job.start()
    text = "".join(streamer)
    job.join()
    want = raw_greedy(model, inputs["input_ids"][0].tolist())
    assert text == tok.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_architecture_through_the_drop_in_names(name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.gguf"
    write_tiny(path, FAMILIES[name])
    pipe = pipeline(
        "text-generation", model=str(path), device_map="auto", torch_dtype=torch.float16
    )
    m, t = pipe.model, pipe.tokenizer
    assert isinstance(m, QllamaForCausalLM) and isinstance(t, QllamaTokenizer)
    want = raw_greedy(m, t(PROMPTS[0])["input_ids"], 5)
    out = pipe(PROMPTS[0], max_new_tokens=5, do_sample=False, return_full_text=False)
    assert out[0]["generated_text"] == t.decode(want, skip_special_tokens=True)
    reply = pipe(CHAT, max_new_tokens=5, do_sample=False)[0]["generated_text"][-1]
    want = raw_greedy(m, m.llm.apply_chat_template(CHAT), 5)
    assert reply == {"role": "assistant", "content": t.decode(want, skip_special_tokens=True)}


def test_qllama_from_pretrained_takes_the_same_keywords(tiny: Path) -> None:
    m = QllamaForCausalLM.from_pretrained(tiny.parent, gguf_file=tiny.name, device_map="cpu")
    assert m.config.gguf_path == str(tiny) and "device_map" not in m.config.load_options
    with pytest.raises(UnsupportedOptionError, match="not a GGUF file"):
        QllamaForCausalLM.from_pretrained(tiny.parent)


# --- the opt-in ---------------------------------------------------------------------------------


def test_install_patches_exactly_three_names_and_uninstall_restores_them(tiny: Path) -> None:
    before = {
        "model": vars(transformers.AutoModelForCausalLM)["from_pretrained"],
        "tokenizer": vars(transformers.AutoTokenizer)["from_pretrained"],
        "pipeline": transformers.pipeline,
        "pipelines.pipeline": transformers.pipelines.pipeline,
        "AutoModel": vars(transformers.AutoModel).get("from_pretrained"),
    }
    assert not qllama.hf.installed()
    qllama.hf.install()
    try:
        qllama.hf.install()  # a second time changes nothing
        assert qllama.hf.installed()
        assert transformers.pipeline is pipeline and transformers.pipelines.pipeline is pipeline
        from transformers import pipeline as imported

        assert imported is pipeline
        assert vars(transformers.AutoModel).get("from_pretrained") is before["AutoModel"]
        m = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), n_ctx=64)
        t = transformers.AutoTokenizer.from_pretrained(str(tiny))
        assert isinstance(m, QllamaForCausalLM) and isinstance(t, QllamaTokenizer)
        assert m.llm.n_ctx == 64
    finally:
        qllama.hf.uninstall()
    assert not qllama.hf.installed()
    assert vars(transformers.AutoModelForCausalLM)["from_pretrained"] is before["model"]
    assert vars(transformers.AutoTokenizer)["from_pretrained"] is before["tokenizer"]
    assert transformers.pipeline is before["pipeline"]
    assert transformers.pipelines.pipeline is before["pipelines.pipeline"]


def test_installed_names_still_load_transformers_checkpoints(
    patched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = Recorder()
    monkeypatch.setitem(auto.ORIGINALS, "AutoModelForCausalLM.from_pretrained", classmethod(record))
    assert transformers.AutoModelForCausalLM.from_pretrained("Qwen/Qwen2-7B", dtype="auto") == (
        "transformers"
    )
    ((args, kwargs),) = record.calls
    assert args == (transformers.AutoModelForCausalLM, "Qwen/Qwen2-7B") and kwargs == {
        "dtype": "auto"
    }


# --- versions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["4.56.2", "5.26.0", "6.0.0"])
def test_untested_versions_warn_naming_the_range(version: str) -> None:
    low, high = compat.TRANSFORMERS_RANGE
    with pytest.warns(compat.UntestedTransformersWarning, match=f"{low} to {high}"):
        assert not compat.check_transformers_version(version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.check_transformers_version(low) and compat.check_transformers_version(high)


def test_a_missing_api_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compat.missing_apis() == []  # the installed transformers has everything
    gone = ("transformers.cache_utils", "NoSuchLayer", None, "what the adapter would need")
    monkeypatch.setattr(compat, "REQUIRED", (*compat.REQUIRED, gone))
    with pytest.raises(ImportError, match="lacks transformers.cache_utils.NoSuchLayer"):
        compat.check_transformers(compat.TRANSFORMERS_RANGE[1])
