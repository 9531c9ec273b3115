"""Drop-in names: ``from qllama.hf import AutoModelForCausalLM, AutoTokenizer, pipeline``.

Each has transformers' signature and behaviour; a call that names a GGUF file (a ``.gguf``
path, a file with the GGUF magic, or a folder or Hub repository with ``gguf_file=``) loads it
through qllama instead (:func:`qllama.hf.loading.gguf_target`), with the keywords mapped by
:func:`qllama.hf.loading.plan`. Every other call goes to transformers untouched: to the
functions captured here at import (:data:`ORIGINALS`), so that :func:`qllama.hf.install`
patching transformers' own names does not loop back into itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import transformers

from qllama.errors import UnsupportedOptionError
from qllama.hf.loading import gguf_target, load_model, load_tokenizer
from qllama.hf.model import QllamaForCausalLM
from qllama.hf.tokenizer import QllamaTokenizer

# transformers' own, as they were before anything here patched them
ORIGINALS: dict[str, Any] = {
    "AutoModelForCausalLM.from_pretrained": inspect.getattr_static(
        transformers.AutoModelForCausalLM, "from_pretrained"
    ),
    "AutoTokenizer.from_pretrained": inspect.getattr_static(
        transformers.AutoTokenizer, "from_pretrained"
    ),
    "pipeline": transformers.pipelines.pipeline,
}
TEXT_GENERATION = "text-generation"
PIPELINE_SIGNATURE = inspect.signature(ORIGINALS["pipeline"])


def _from_pretrained(
    which: str,
    load: Callable[[str, dict[str, Any]], Any],
    owner: type,
    pretrained_model_name_or_path: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``owner.from_pretrained`` of transformers' ``which``: a GGUF file through ``load``
    (its path and the keywords), anything else transformers' own call, untouched."""
    target = gguf_target(pretrained_model_name_or_path, kwargs.get("gguf_file"))
    if target is None:
        original = ORIGINALS[f"{which}.from_pretrained"].__get__(None, owner)
        return original(pretrained_model_name_or_path, *args, **kwargs)
    if args:
        raise UnsupportedOptionError(
            f"{which}.from_pretrained of a GGUF file takes the path and keywords only, not "
            f"{len(args)} more positional arguments"
        )
    kwargs.pop("gguf_file", None)
    return load(target, kwargs)


def model_from_pretrained(
    owner: type, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any
) -> Any:
    """``owner.from_pretrained``: a GGUF through qllama, anything else transformers'."""
    return _from_pretrained(
        "AutoModelForCausalLM",
        lambda target, kw: load_model(target, kw, QllamaForCausalLM),
        owner,
        pretrained_model_name_or_path,
        args,
        kwargs,
    )


def tokenizer_from_pretrained(
    owner: type, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any
) -> Any:
    """``owner.from_pretrained``: a GGUF's QllamaTokenizer, anything else transformers'."""
    return _from_pretrained(
        "AutoTokenizer", load_tokenizer, owner, pretrained_model_name_or_path, args, kwargs
    )


class AutoModelForCausalLM(transformers.AutoModelForCausalLM):
    """transformers' ``AutoModelForCausalLM``, loading GGUF files through qllama.

    ``from_pretrained("model.Q4_K_M.gguf", device_map="auto", torch_dtype=torch.float16,
    n_ctx=4096, n_threads=8, n_gpu_layers=-1)`` returns a
    :class:`~qllama.hf.model.QllamaForCausalLM` with the file's weights as stored;
    ``backend=``, ``dequantize_all=``, ``activations=`` choose the arithmetic
    (:data:`qllama.hf.loading.MODEL_KEYWORDS` lists every keyword). Other paths and repository
    ids are transformers' own loading.
    """

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any
    ) -> Any:
        return model_from_pretrained(
            transformers.AutoModelForCausalLM, pretrained_model_name_or_path, *model_args, **kwargs
        )


class AutoTokenizer(transformers.AutoTokenizer):
    """transformers' ``AutoTokenizer``; a GGUF file gives its
    :class:`~qllama.hf.tokenizer.QllamaTokenizer` (llama.cpp's ids, the file's chat template)."""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: Any, *inputs: Any, **kwargs: Any
    ) -> Any:
        return tokenizer_from_pretrained(
            transformers.AutoTokenizer, pretrained_model_name_or_path, *inputs, **kwargs
        )


# pipeline() arguments that only say how to load the model; the GGUF loading takes them
_LOADING = (
    "config", "revision", "use_fast", "token", "device", "device_map", "dtype",
    "trust_remote_code", "model_kwargs",
)  # fmt: skip
_PROCESSORS = ("feature_extractor", "image_processor", "video_processor", "processor")


def _tokenizer_for(tokenizer: Any, model: Any, hub: dict[str, Any]) -> Any:
    """The pipeline's tokenizer: the GGUF's own unless another is given."""
    if tokenizer is None and isinstance(model, QllamaForCausalLM):
        return QllamaTokenizer.from_llm(model)
    if isinstance(tokenizer, str):
        return AutoTokenizer.from_pretrained(tokenizer, **hub)
    return tokenizer


def _gguf_pipeline(original: Any, arguments: dict[str, Any], target: str) -> Any:
    """``pipeline(...)`` for a GGUF model: load it through qllama, then transformers'
    pipeline around the loaded model and tokenizer."""
    task = arguments.pop("task", None)
    if task not in (None, TEXT_GENERATION):
        raise UnsupportedOptionError(
            f"pipeline({task!r}) of a GGUF file: qllama runs causal language models, "
            f"so the task is {TEXT_GENERATION!r}"
        )
    given = [k for k in ("config", *_PROCESSORS) if arguments.get(k) is not None]
    if given:
        raise UnsupportedOptionError(
            f"pipeline of a GGUF file takes no {given}: the file is the configuration "
            "and the tokenizer"
        )
    extra = arguments.pop("kwargs", {})
    load = dict(arguments.get("model_kwargs") or {})
    for key in ("device_map", "trust_remote_code", "revision", "token"):
        if arguments.get(key) is not None:
            load[key] = arguments[key]
    if arguments.get("device") is not None:
        if "device_map" in load:
            raise UnsupportedOptionError("pipeline: pass device or device_map, not both")
        load["device"] = arguments["device"]
    for key in ("dtype", "torch_dtype", "gguf_file"):
        if key in extra:
            load[key] = extra.pop(key)
    if arguments.get("dtype") not in (None, "auto"):
        load["dtype"] = arguments["dtype"]
    load.pop("gguf_file", None)
    model = load_model(target, load, QllamaForCausalLM)
    hub = {k: load[k] for k in ("revision", "token") if k in load}
    tokenizer = _tokenizer_for(arguments.get("tokenizer"), model, hub)
    rest = {k: v for k, v in arguments.items() if k not in (*_LOADING, "model", "tokenizer")}
    rest = {k: v for k, v in rest.items() if k not in _PROCESSORS}
    return original(TEXT_GENERATION, model=model, tokenizer=tokenizer, **rest, **extra)


def pipeline(*args: Any, **kwargs: Any) -> Any:
    """transformers' ``pipeline``; ``model=`` a GGUF file (or a folder or Hub repository with
    ``model_kwargs={"gguf_file": ...}``) loads it through qllama for ``"text-generation"``,
    with the GGUF's own tokenizer unless ``tokenizer=`` names another."""
    original = ORIGINALS["pipeline"]
    arguments = dict(PIPELINE_SIGNATURE.bind(*args, **kwargs).arguments)
    model = arguments.get("model")
    extra = arguments.get("kwargs", {})
    gguf_file = (arguments.get("model_kwargs") or {}).get("gguf_file", extra.get("gguf_file"))
    target = gguf_target(model, gguf_file)
    if target is not None:
        return _gguf_pipeline(original, arguments, target)
    if isinstance(model, QllamaForCausalLM) and arguments.get("tokenizer") is None:
        arguments["tokenizer"] = _tokenizer_for(None, model, {})
    extra = arguments.pop("kwargs", {})
    return original(**arguments, **extra)


pipeline.__signature__ = PIPELINE_SIGNATURE  # type: ignore[attr-defined]
