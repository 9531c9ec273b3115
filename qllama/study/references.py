"""The study's references: one per prompt, computed once, cached, named by their content.

A reference is the prompt's ids, the reference model's greedy continuation and the logits of
every position (:class:`qllama.measure.compare.Reference`). It is cached in
``<results>/references/<request>.npz`` under a *request* key (what was asked: the file's hash,
the prompt's ids, the kind, the environment), and carries a *content* key (the sha256 of its
tokens and logits) that the cells' keys use: a reference recomputed on another machine moves
by about 1e-5 and gets another content key, so its cells are rerun rather than reused.

A draw's ``reference_env`` recomputes the logits of the *same* tokens in another environment
(other kernels): the reference moves, the teacher-forced sequence does not.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qllama.measure.compare import Reference
from qllama.study.declaration import Prompt, ReferenceSpec, StudyError, toml_inline
from qllama.study.variants import VariantFile
from qllama.version import __version__

# the packages whose versions a transformers reference records (and is recomputed for)
REFERENCE_PACKAGES = ("numpy", "torch", "transformers", "accelerate", "gguf")


@dataclass(frozen=True)
class ReferenceTask:
    """Everything a worker needs to compute one reference."""

    request: str
    prompt: Prompt
    spec: ReferenceSpec
    variant: VariantFile
    source: str
    prompt_ids: tuple[int, ...]
    stop_ids: tuple[int, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    tokens_of: str | None = None  # the reference whose tokens are kept (a recomputation)
    tokens_key: str | None = None


def content_key(ref: Reference) -> str:
    """The sha256 of the reference's tokens, prompt length and logits (32 hex digits)."""
    h = hashlib.sha256()
    h.update(np.asarray(ref.tokens, "<i8").tobytes())
    h.update(np.asarray([ref.n_prompt], "<i8").tobytes())
    h.update(np.ascontiguousarray(ref.logits, "<f4").tobytes())
    return h.hexdigest()[:32]


def prompt_ids(prompt: Prompt, path: str | Path) -> tuple[list[int], list[int]]:
    """The prompt's ids and the stop ids, from qllama's tokenizer (llama.cpp's ids) and the
    file's chat template."""
    from qllama.errors import ChatTemplateError
    from qllama.gguf.reader import read_gguf
    from qllama.runtime.chat_template import ChatTemplate
    from qllama.runtime.tokenizer import Tokenizer

    with read_gguf(path) as f:
        tok = Tokenizer.from_gguf(f)
        template = f.get("tokenizer.chat_template")
    if not prompt.chat:
        ids = tok.encode(prompt.text)
    elif isinstance(template, str):
        messages = prompt.messages or ({"role": "user", "content": prompt.text},)
        ids = ChatTemplate(template, tok).encode(list(messages))
    else:
        raise ChatTemplateError(f"prompt {prompt.name!r} is a chat turn; the file has no template")
    return ids, sorted(tok.stop_ids)


def request_key(task_fields: Mapping[str, Any]) -> str:

    meta = {**task_fields, "qllama": __version__}
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]


def versions() -> dict[str, str]:
    """The installed versions of the reference's packages (absent ones left out)."""
    out = {"python": platform.python_version()}
    for name in REFERENCE_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def stale(ref: Reference) -> bool:
    """Whether a package the cached reference was computed with is installed here in another
    version (then it is recomputed; a package absent here says nothing)."""
    recorded = ref.meta.get("versions", {})
    here = versions()
    return any(k in here and k != "python" and here[k] != v for k, v in recorded.items())


class ReferenceStore:
    """Cached references under ``folder/references``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder) / "references"

    def path(self, request: str) -> Path:
        return self.folder / f"{request}.npz"

    def load(self, request: str) -> Reference | None:
        path = self.path(request)
        if not path.is_file():
            return None
        ref = Reference.load(str(path))
        return ref if ref.meta.get("request") == request else None

    def save(self, ref: Reference) -> Path:
        path = self.path(str(ref.meta["request"]))
        ref.save(str(path))
        return path


def _threads(n: int | None) -> None:
    if n is not None:
        import torch

        torch.set_num_threads(n)


def _transformers(task: ReferenceTask, path: Path, tokens: list[int] | None) -> Reference:
    from qllama.measure.reference import load_transformers, transformers_reference

    _threads(task.spec.threads)
    if tokens is None:
        return transformers_reference(
            path,
            task.prompt_ids,
            max_new_tokens=task.prompt.max_new_tokens,
            stop_ids=task.stop_ids,
        )
    import torch

    model = load_transformers(path)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float().numpy()
    return Reference(tokens, len(task.prompt_ids), logits, {})


def _qllama(task: ReferenceTask, path: Path, tokens: list[int] | None) -> Reference:
    from qllama.array_api import to_numpy
    from qllama.measure.compare import reference_from_model
    from qllama.runtime.loader import load

    model = load(path, backend=task.spec.backend, **task.spec.options)
    if tokens is None:
        return reference_from_model(
            model, task.prompt_ids, max_new_tokens=task.prompt.max_new_tokens
        )
    logits = to_numpy(model.forward(tokens, pos=0, all_logits=True)).astype(np.float32)
    return Reference(tokens, len(task.prompt_ids), logits, {})


def _saved(task: ReferenceTask, folder: Path) -> Reference:
    path = Path(task.spec.paths[task.prompt.name])
    ref = Reference.load(str(path if path.is_absolute() else folder / path))
    if ref.tokens[: ref.n_prompt] != list(task.prompt_ids):
        raise StudyError(f"{path} was made for another prompt than {task.prompt.name!r}")
    return ref


def compute(task: ReferenceTask, folder: Path = Path(".")) -> Reference:
    """Compute the reference of ``task`` here (the worker's side), with its provenance."""
    from qllama.study.variants import resolve

    tokens = None
    if task.tokens_of is not None:
        base = Reference.load(task.tokens_of)
        if content_key(base) != task.tokens_key:
            raise StudyError(f"the reference {task.tokens_of} changed while the study ran")
        tokens = base.tokens
    if task.spec.kind == "saved":
        ref = _saved(task, folder)
    else:
        path = resolve(task.variant, task.source)
        ref = (_transformers if task.spec.kind == "transformers" else _qllama)(task, path, tokens)
    ref.meta = provenance(task) | {"key": content_key(ref)}
    return ref


def provenance(task: ReferenceTask) -> dict[str, Any]:
    """What the reference depends on, as it records it."""
    about = {
        "transformers": "transformers AutoModelForCausalLM, gguf_file=, float32, eager, CPU, "
        "greedy",
        "qllama": f"qllama on {task.spec.backend}"
        + (f" with {toml_inline(task.spec.options)}" if task.spec.options else "")
        + ", greedy",
        "saved": f"saved: {task.spec.paths.get(task.prompt.name, '')}",
    }[task.spec.kind]
    return {
        "request": task.request,
        "kind": task.spec.kind,
        "file": Path(task.variant.path).name,
        "file_sha256": task.variant.sha256,
        "prompt": task.prompt.name,
        "text": task.prompt.text,
        "messages": [dict(m) for m in task.prompt.messages],
        "chat": task.prompt.chat,
        "prompt_ids": list(task.prompt_ids),
        "stop_ids": list(task.stop_ids),
        "max_new_tokens": task.prompt.max_new_tokens,
        "settings": about,
        "env": dict(task.env),
        "threads": task.spec.threads,
        "tokens_of": task.tokens_key,
        "versions": versions(),
    }


def task_fields(
    spec: ReferenceSpec,
    prompt: Prompt,
    variant: VariantFile,
    ids: Sequence[int],
    stop_ids: Sequence[int],
    env: Mapping[str, str],
    tokens_key: str | None,
) -> dict[str, Any]:
    """What a reference request depends on (the request key hashes it)."""
    return {
        "kind": spec.kind,
        "file_sha256": variant.sha256,
        "backend": spec.backend if spec.kind == "qllama" else None,
        "options": dict(spec.options) if spec.kind == "qllama" else None,
        "saved": spec.paths.get(prompt.name) if spec.kind == "saved" else None,
        "prompt_ids": list(ids),
        "stop_ids": list(stop_ids),
        "max_new_tokens": prompt.max_new_tokens,
        "env": dict(env),
        "threads": spec.threads,
        "tokens_of": tokens_key,
    }
