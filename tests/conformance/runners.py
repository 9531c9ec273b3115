"""The references the conformance models are run on: llama.cpp's CPU (through
llama-cpp-python) on a GGUF file, its intermediate tensors, its chat templates (the Jinja
engine of llama-server and the C engine of libllama) and its tokenizer; and transformers' own
modeling code on the saved safetensors.

Kept apart from the builder (tests/conformance/__init__.py) so that a change here does not
change the built models' content key.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from conformance import Built

KV_TYPES = {"f32": 0, "f16": 1}  # GGML_TYPE_F32, GGML_TYPE_F16


class LlamaCpp:
    """llama.cpp's CPU on one file through llama-cpp-python: logits of every position,
    greedy decoding. ``kv`` is the KV cache's type (llama.cpp's default is f16)."""

    def __init__(self, path: Path, *, kv: str = "f32", n_ctx: int = 256) -> None:
        import llama_cpp

        self.model = llama_cpp.Llama(
            str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=n_ctx,
            n_threads=2,
            logits_all=True,
            type_k=KV_TYPES[kv],
            type_v=KV_TYPES[kv],
            flash_attn=False,
            swa_full=True,
            seed=0,
            verbose=False,
        )

    def logits(self, ids: list[int]) -> Any:
        """(len(ids), vocab) float32: one forward pass over ``ids`` from an empty cache."""
        import numpy as np

        self.model.reset()
        self.model.eval(ids)
        return np.array(self.model.scores[: len(ids)], dtype=np.float32)

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], Any]:
        """``n`` greedy tokens after ``ids`` (prefill, then one token at a time), and the
        logits each was chosen from: (n, vocab) float32."""
        import numpy as np

        self.model.reset()
        self.model.eval(ids)
        out: list[int] = []
        steps = []
        for _ in range(n):
            step = np.array(self.model.scores[self.model.n_tokens - 1], dtype=np.float32)
            steps.append(step)
            out.append(int(np.argmax(step)))
            self.model.eval([out[-1]])
        return out, np.stack(steps)

    def close(self) -> None:
        self.model.close()


def transformers_logits(built: Built, ids: list[int]) -> Any:
    """transformers' own modeling code on the saved safetensors, f32, eager attention."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        built.hf, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


# --- chat templates: llama.cpp's Jinja engine (llama-server), its C engine, its tokenizer ----


def c_template(
    template: str, messages: list[dict[str, str]], *, add_generation_prompt: bool
) -> str:
    """llama.cpp's C template engine (``llama_chat_apply_template``): it recognises the family
    from substrings of ``template`` and writes that family's format itself, without Jinja."""
    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))(
        *(llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages)
    )
    size = 4096 + 2 * sum(len(m["content"]) for m in messages)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(
        template.encode(), chat, len(messages), add_generation_prompt, buf, size
    )
    if n < 0:
        raise ValueError("llama.cpp's C engine does not recognise this template")
    assert n <= size, "the buffer was too small"
    return buf.raw[:n].decode()


def llama_cpp_tokens(vocab: Path, text: str) -> list[int]:
    """llama.cpp's tokenizer on a vocabulary file: special tokens parsed, no BOS added."""
    import llama_cpp

    model = llama_cpp.Llama(str(vocab), vocab_only=True, verbose=False)
    try:
        return list(model.tokenize(text.encode(), add_bos=False, special=True))
    finally:
        model.close()


class LlamaServer:
    """llama-server on one model, bound to 127.0.0.1 for the life of a test: its
    ``/apply-template`` renders with llama.cpp's own Jinja engine (common/jinja, as
    ``llama-server --jinja`` and ``llama-cli`` do), ``/tokenize`` with its tokenizer."""

    def __init__(self, bin_dir: Path, model: Path, *, template: Path, timeout: float = 60) -> None:
        import os
        import socket
        import subprocess
        import tempfile
        import time

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
        cmd = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "-c", "256", "-t", "1", "--no-webui", "--jinja"]
        # a final assistant message closes its turn, as transformers' add_generation_prompt=False
        # (by default the server would leave it open for the model to continue)
        cmd += ["--chat-template-file", str(template), "--no-prefill-assistant"]
        self.log = tempfile.TemporaryFile("w+")  # the server logs a lot: a pipe would fill
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=self.log, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"llama-server exited: {self.log.read()[-2000:]}")
            try:
                if self._request("GET", "/health", None, timeout=2).get("status") == "ok":
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.close()
        raise TimeoutError(f"llama-server did not answer within {timeout} s")

    def _request(self, method: str, path: str, body: Any, *, timeout: float = 30) -> Any:
        import json
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, method=method
        )
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def apply_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool, **kwargs: Any
    ) -> str:
        body = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "chat_template_kwargs": kwargs,
        }
        return str(self._request("POST", "/apply-template", body)["prompt"])

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Special tokens parsed; with ``add_special`` the vocabulary's BOS (and EOS) added as
        they are for a prompt the server runs."""
        body = {"content": text, "add_special": add_special, "parse_special": True}
        return [int(t) for t in self._request("POST", "/tokenize", body)["tokens"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- llama.cpp's intermediate tensors ---------------------------------------------------------


class _GgmlTensor(ctypes.Structure):
    """The head of ggml's ``struct ggml_tensor`` (ggml/include/ggml.h of the pinned tree), as
    far as the name and the data: the eval callback hands the tensor over by pointer."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),  # GGML_MAX_OP_PARAMS / sizeof(int32_t)
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),  # GGML_MAX_SRC
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),  # GGML_MAX_NAME
    ]


def llama_cpp_trace(path: Path, ids: list[int], names: set[str]) -> tuple[dict[str, Any], Any]:
    """llama.cpp's CPU forward pass over ``ids`` (f32 KV cache, one batch), keeping the first
    computed value of each graph tensor named in ``names`` (e.g. ``ffn_norm-0``) as a
    (len(ids), width) float32 array, through the scheduler's eval callback. Returns the
    tensors and the logits (len(ids), vocab)."""
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    kept: dict[str, Any] = {}

    @L.ggml_backend_sched_eval_callback
    def observe(t: int, ask: bool, _user: Any) -> bool:
        tensor = ctypes.cast(t, ctypes.POINTER(_GgmlTensor)).contents
        name = tensor.name.decode()
        if ask:
            return name in names and name not in kept
        ne, nb = list(tensor.ne), list(tensor.nb)
        if tensor.type == 0 and nb[0] == 4 and nb[1] == 4 * ne[0] and name not in kept:  # F32
            n = ne[0] * ne[1] * ne[2] * ne[3]
            data = np.ctypeslib.as_array((ctypes.c_float * n).from_address(tensor.data))
            kept[name] = data.reshape(len(ids), -1).copy()
        return True

    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = max(256, len(ids))
    params.n_threads = params.n_threads_batch = 2
    params.type_k = params.type_v = KV_TYPES["f32"]
    params.flash_attn_type = 0  # off, as LlamaCpp
    params.cb_eval = observe
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(len(ids), 0, 1)
    try:
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, True
        batch.n_tokens = len(ids)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(ids), n_vocab)).copy()
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return kept, logits
