"""What a transformers-style ``from_pretrained`` call means for a GGUF file, and loading it.

Two jobs, both for :mod:`qllama.hf.auto` (the drop-in names) and :mod:`qllama.hf.install`
(transformers' own names, patched):

- :func:`gguf_target`: whether a call names a GGUF file (a ``.gguf`` path, a file that starts
  with the GGUF magic, or a folder or Hub repository with ``gguf_file=``); anything else is
  transformers' to load, untouched. A ``.gguf`` path is qllama's even when the file is absent
  or broken, so a renamed safetensors or a truncated download gets qllama's error
  (:class:`~qllama.errors.GGUFMagicError`, :class:`~qllama.errors.GGUFTruncatedError`), not
  transformers' complaint about a missing ``config.json``;
- :func:`plan`: the keywords such scripts pass (transformers', llama-cpp-python's, qllama's)
  mapped onto :func:`qllama.load`'s options, each with a note of what it does here
  (:data:`MODEL_KEYWORDS` lists them). Any other keyword is refused, naming the accepted
  ones: nothing a script asks for is dropped silently.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qllama import defaults
from qllama.errors import UnsupportedOptionError

logger = logging.getLogger("qllama.hf")

GGUF_MAGIC = b"GGUF"

# keyword -> what it does here (the error for an unknown keyword lists these)
TRANSFORMERS_KEYWORDS = {
    "device_map": "'auto' (cuda, else mps, else cpu), one device, or a map onto one device",
    "torch_dtype": "accepted; the weights stay as the file stores them (never widened)",
    "dtype": "as torch_dtype (its name from transformers 5)",
    "trust_remote_code": "ignored: a GGUF file carries no code",
    "low_cpu_mem_usage": "accepted: the file is memory-mapped, never copied whole",
    "gguf_file": "the GGUF file inside the folder or Hub repository named first",
}
LLAMA_CPP_KEYWORDS = {
    "n_ctx": "the context length (qllama.load's n_ctx)",
    "n_threads": "CPU threads (numpy: its kernels' threads; torch: torch.set_num_threads)",
    "n_gpu_layers": "0: the CPU; -1 or every layer: the GPU when there is one",
    "low_vram": "accepted: the weights already stay packed on the device",
}
QLLAMA_KEYWORDS = {
    "backend": "the arithmetic: numpy (llama.cpp's CPU), torch (the GPU's), jax, ...",
    "device": "the backend's device (as device_map with one device)",
    "dequantize_all": "widen every weight to float32 at load (transformers' arithmetic)",
    "activations": "numpy: 'q8' (llama.cpp's CPU) or 'f32'",
    "activation_rounding": "numpy: 'ref' or 'simd'",
    "simd_width": "numpy: the llama.cpp build's float lanes, 8 (AVX2), 16 (AVX-512) or 'host'",
    "kernels": "numpy: 'numba' or 'numpy'",
    "blas_threads": "numpy: BLAS threads",
    "work_bytes": "numpy: the work buffer's size",
    "kv_precision": "'f32', 'f16', 'f16-flash', or llama.cpp's cache types as 'K/V[,fa]' "
    "(e.g. 'q8_0/q4_0,fa'; numpy)",
    "check_weights": "refuse NaN/inf weights at load",
    "trace_nonfinite": "name the first layer whose output is NaN/inf",
    "arithmetic": "an arithmetic per tensor-name pattern",
    "weights_from": "tensors replaced from other files",
}
# where a Hub repository's file is fetched from (huggingface_hub's keywords)
HUB_KEYWORDS = {
    "revision": "the Hub revision of gguf_file",
    "cache_dir": "where the Hub download is kept",
    "token": "the Hub token",
    "local_files_only": "no download: the Hub cache only",
    "force_download": "download gguf_file again",
    "subfolder": "gguf_file's folder in the repository",
}
MODEL_KEYWORDS = {**TRANSFORMERS_KEYWORDS, **LLAMA_CPP_KEYWORDS, **QLLAMA_KEYWORDS, **HUB_KEYWORDS}
TOKENIZER_KEYWORDS = {
    "trust_remote_code": TRANSFORMERS_KEYWORDS["trust_remote_code"],
    "use_fast": "ignored: there is one tokenizer, qllama's (llama.cpp's ids)",
    "gguf_file": TRANSFORMERS_KEYWORDS["gguf_file"],
    # transformers' own tokenizer settings, passed to QllamaTokenizer
    "padding_side": "'left' (the default: generation batches) or 'right'",
    "truncation_side": "transformers' setting",
    "model_max_length": "transformers' setting (default: the file's context length)",
    "chat_template": "a template instead of the file's",
    "clean_up_tokenization_spaces": "transformers' setting (default False, as llama.cpp)",
    "split_special_tokens": "encode special-token texts as text",
    "bos_token": "transformers' setting",
    "eos_token": "transformers' setting",
    "unk_token": "transformers' setting",
    "pad_token": "transformers' setting",
    **HUB_KEYWORDS,
}
# the ones QllamaTokenizer takes as transformers' tokenizers do
TOKENIZER_SETTINGS = frozenset(TOKENIZER_KEYWORDS) - {"trust_remote_code", "use_fast", "gguf_file"}
TOKENIZER_SETTINGS = TOKENIZER_SETTINGS - set(HUB_KEYWORDS)

# float widths a script may ask for; none of them changes qllama's weights or arithmetic
DTYPES = ("auto", "float32", "float16", "bfloat16")
# device_map strategies that spread the layers over several devices
SPREADING = ("balanced", "balanced_low_0", "sequential")


# -- which calls are qllama's --------------------------------------------------------------------


def _is_gguf_file(path: str) -> bool:
    """A regular file whose first bytes are the GGUF magic (whatever its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _is_local(name: str) -> bool:
    """A path on this machine rather than a Hub repository id ("org/name")."""
    return os.path.exists(name) or name.startswith(("./", "../", "/", "~", ".\\", "..\\"))


def gguf_target(name_or_path: Any, gguf_file: Any = None) -> str | None:
    """The GGUF file a ``from_pretrained(name_or_path, gguf_file=...)`` call names, as a
    local path or ``"hub:repo/file"``; None when the call is transformers' (no GGUF named)."""
    if not isinstance(name_or_path, str | os.PathLike):
        return None
    name = os.fspath(name_or_path)
    if gguf_file is not None:
        if os.path.isdir(name) or _is_local(name):
            return os.path.join(name, os.fspath(gguf_file))
        return f"hub:{name}:{os.fspath(gguf_file)}"
    if name.lower().endswith(".gguf"):
        return name
    if os.path.isfile(name) and _is_gguf_file(name):
        return name
    return None


def fetch(target: str, hub: Mapping[str, Any]) -> Path:
    """The local path of ``target``: a Hub file downloaded (huggingface_hub's cache)."""
    if not target.startswith("hub:"):
        return Path(os.path.expanduser(target))
    _, repo, filename = target.split(":", 2)
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id=repo, filename=filename, **hub))


# -- the keywords --------------------------------------------------------------------------------


@dataclass
class LoadPlan:
    """What a call's keywords mean for :func:`qllama.load`."""

    options: dict[str, Any] = field(default_factory=dict)  # qllama.load's keywords
    hub: dict[str, Any] = field(default_factory=dict)  # huggingface_hub's, for a Hub file
    torch_threads: int | None = None  # torch.set_num_threads, for the torch backend
    notes: list[str] = field(default_factory=list)  # what each keyword did, in words


def refuse_unknown(kwargs: Mapping[str, Any], accepted: Mapping[str, str], what: str) -> None:
    """Refuse keywords outside ``accepted``, listing the accepted ones."""
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise UnsupportedOptionError(
            f"{what} of a GGUF file (through qllama) does not take {unknown}; it takes "
            + ", ".join(sorted(accepted))
            + " (docs/transformers.md says what each does)"
        )


def _dtype_name(value: Any) -> str:
    """'float16' for torch.float16 or "float16"; the repr otherwise."""
    if value is None or isinstance(value, str):
        return str(value)
    return str(value).removeprefix("torch.")


def _dtype(kwargs: Mapping[str, Any], notes: list[str]) -> None:
    """``torch_dtype``/``dtype``: accepted when a float width; never applied to the weights."""
    given = {k: kwargs[k] for k in ("torch_dtype", "dtype") if kwargs.get(k) is not None}
    names = {k: _dtype_name(v) for k, v in given.items()}
    if len(set(names.values())) > 1:
        raise UnsupportedOptionError(f"torch_dtype and dtype disagree: {names}")
    for key, name in names.items():
        if name not in DTYPES:
            raise UnsupportedOptionError(
                f"{key}={name}: qllama computes with the file's weights and float32 "
                f"activations; it accepts {DTYPES} and changes neither"
            )
        if name != "auto":
            notes.append(
                f"{key}={name}: the weights stay as the file stores them (never widened or "
                "cast); the arithmetic is the backend's and the logits are float32 "
                "(model.dtype)"
            )
            return


def _torch_devices() -> tuple[str, ...]:
    """The torch devices here, the best first (cuda, mps, cpu)."""
    from qllama.backends.torch import devices

    return devices()


def _device(value: Any) -> str:
    """One device's name: 'cpu', 'cuda:0', 'mps'; an int is a CUDA index."""
    if isinstance(value, bool):
        raise UnsupportedOptionError(f"device {value!r} is not a device")
    if isinstance(value, int):
        return "cpu" if value < 0 else f"cuda:{value}"
    name = str(value)
    if name == "disk":
        raise UnsupportedOptionError(
            "device_map offloads to disk: qllama maps the file and keeps every layer on one device"
        )
    return name


def _device_map(value: Any) -> str:
    """The one device a ``device_map`` asks for ('auto' stays 'auto'); a split is refused."""
    if isinstance(value, Mapping):
        devices = sorted({_device(v) for v in value.values()})
        if len(devices) > 1:
            raise UnsupportedOptionError(
                f"device_map splits the model across {devices}: qllama runs every layer on one "
                "device (one backend holds the weights and the KV cache); pass one device or "
                "device_map='auto'"
            )
        return devices[0] if devices else "auto"
    if value in SPREADING:
        raise UnsupportedOptionError(
            f"device_map={value!r} spreads the layers over several devices: qllama runs every "
            "layer on one device; pass device_map='auto' or one device"
        )
    return "auto" if value == "auto" else _device(value)


def _block_count(path: Path) -> int | None:
    """The file's layer count, read from its header (None when absent)."""
    from qllama.gguf.reader import read_gguf

    with read_gguf(path) as f:
        arch = f.get("general.architecture")
        count = f.get(f"{arch}.block_count")
    return int(count) if isinstance(count, int) else None


def _gpu_layers(n: int, path: Path, notes: list[str]) -> str:
    """``n_gpu_layers`` as a device: 0 the CPU; -1 or every layer the GPU ('auto')."""
    if n == 0:
        notes.append("n_gpu_layers=0: the CPU")
        return "cpu"
    layers = _block_count(path) if n > 0 else None
    if n > 0 and (layers is None or n < layers):
        raise UnsupportedOptionError(
            f"n_gpu_layers={n} of the file's {layers} layers: llama.cpp would split the model "
            "between the GPU and the CPU; qllama runs every layer on one device: "
            f"n_gpu_layers=-1 (or >= {layers}) for the GPU, 0 for the CPU"
        )
    notes.append(f"n_gpu_layers={n}: every layer on one device, the GPU if there is one")
    return "auto"


def _backend_name(backend: Any) -> str:
    """The name of a backend given by name, as an object, or not at all (the default)."""
    if backend is None or isinstance(backend, str):
        return defaults.backend(backend)
    return str(getattr(backend, "name", type(backend).__name__))


def _where(kwargs: Mapping[str, Any], path: Path, notes: list[str]) -> tuple[Any, str | None]:
    """The backend and device: from ``device_map``, ``device`` and ``n_gpu_layers``."""
    backend = kwargs.get("backend")
    wanted = None
    if kwargs.get("device_map") is not None:
        wanted = _device_map(kwargs["device_map"])
    if kwargs.get("device") is not None:
        device = _device(kwargs["device"])
        if wanted not in (None, device):
            raise UnsupportedOptionError(
                f"device={device!r} and device_map={kwargs['device_map']!r} disagree"
            )
        wanted = device
    layers = kwargs.get("n_gpu_layers")
    if layers is not None:
        by_layers = _gpu_layers(int(layers), path, notes)
        if wanted is None:
            wanted = by_layers
        elif by_layers != wanted:
            notes.append(f"n_gpu_layers={layers}: the device is device_map's ({wanted})")
    if wanted is None:
        return backend, None
    if wanted == "auto":
        # numpy and the other CPU-only backends take the CPU; otherwise torch's best device
        if backend is not None and _backend_name(backend) != "torch":
            wanted = "cpu"
        else:
            wanted = _torch_devices()[0]
        notes.append(f"device_map='auto': {wanted}")
    if wanted.split(":")[0] in ("cuda", "mps") and backend is None:
        backend = "torch"  # the GPU arithmetic: the one backend on cuda and mps
        notes.append(f"device {wanted}: backend torch (the GPU arithmetic)")
    if wanted == "cpu" and backend is None:
        return None, None  # qllama's default backend, on its default (the CPU)
    return backend, wanted


def _numba_threads() -> int:
    """The most threads numba's kernels can use in this process (its thread pool's size)."""
    try:
        from numba.core import config
    except ImportError:
        return os.cpu_count() or 1  # no kernels: the option is recorded, nothing uses it
    return int(getattr(config, "NUMBA_NUM_THREADS", os.cpu_count() or 1))


def _threads(
    n: int, backend: Any, options: dict[str, Any], notes: list[str]
) -> tuple[int | None, str]:
    """``n_threads`` for the backend: numpy's kernel threads, or torch's (process-wide)."""
    name = _backend_name(backend)
    if name == "numpy":
        most = _numba_threads()
        options["threads"] = min(n, most)
        if n > most:  # numba refuses more threads than it started with (llama.cpp does not)
            return None, (
                f"n_threads={n}: the numpy backend's kernel threads, {most} (numba's most here: "
                "NUMBA_NUM_THREADS, the cores by default)"
            )
        return None, f"n_threads={n}: the numpy backend's kernel threads"
    if name == "torch":
        return n, f"n_threads={n}: torch.set_num_threads({n}) (process-wide: torch has no other)"
    raise UnsupportedOptionError(
        f"n_threads: the {name} backend has no thread count to set; use numpy or torch"
    )


def plan(kwargs: Mapping[str, Any], path: Path) -> LoadPlan:
    """The options :func:`qllama.load` gets for a ``from_pretrained(path, **kwargs)`` call."""
    refuse_unknown(kwargs, MODEL_KEYWORDS, "from_pretrained")
    out = LoadPlan()
    notes = out.notes
    out.hub = {k: v for k, v in kwargs.items() if k in HUB_KEYWORDS}
    for key in QLLAMA_KEYWORDS:
        if key in kwargs and key not in ("backend", "device"):
            out.options[key] = kwargs[key]
    _dtype(kwargs, notes)
    backend, device = _where(kwargs, path, notes)
    if backend is not None:
        out.options["backend"] = backend
    if device is not None:
        out.options["device"] = device
    if kwargs.get("n_ctx") is not None:
        out.options["n_ctx"] = int(kwargs["n_ctx"])
    if kwargs.get("n_threads") is not None:
        out.torch_threads, note = _threads(int(kwargs["n_threads"]), backend, out.options, notes)
        notes.append(note)
    if kwargs.get("low_vram"):
        notes.append(
            "low_vram: nothing to lower; the weights stay as the file stores them (the torch "
            "backend dequantizes inside each matmul)"
        )
    if kwargs.get("trust_remote_code"):
        notes.append("trust_remote_code: ignored (a GGUF file carries no code)")
    return out


def load_model(target: str, kwargs: Mapping[str, Any], model_class: Any) -> Any:
    """A ``model_class`` (:class:`~qllama.hf.model.QllamaForCausalLM`, passed in: the model
    module uses this one) for a GGUF ``target`` and a call's keywords.

    The notes of what each keyword did are logged (logger ``qllama.hf``, INFO) and kept in
    ``model.load_notes``.
    """
    hub = {k: v for k, v in kwargs.items() if k in HUB_KEYWORDS}
    refuse_unknown(kwargs, MODEL_KEYWORDS, "from_pretrained")
    path = fetch(target, hub)
    load = plan(kwargs, path)
    if load.torch_threads is not None:
        import torch

        torch.set_num_threads(load.torch_threads)
    model = model_class.from_gguf(path, **load.options)
    model.config.name_or_path = os.fspath(path)
    model.load_notes = tuple(load.notes)
    for note in load.notes:
        logger.info("%s: %s", path.name, note)
    return model


def load_tokenizer(target: str, kwargs: Mapping[str, Any]) -> Any:
    """A :class:`~qllama.hf.tokenizer.QllamaTokenizer` for a GGUF ``target``."""
    from qllama.hf.tokenizer import QllamaTokenizer

    refuse_unknown(kwargs, TOKENIZER_KEYWORDS, "AutoTokenizer.from_pretrained")
    path = fetch(target, {k: v for k, v in kwargs.items() if k in HUB_KEYWORDS})
    settings = {k: v for k, v in kwargs.items() if k in TOKENIZER_SETTINGS}
    return QllamaTokenizer.from_gguf(path, name_or_path=os.fspath(path), **settings)
