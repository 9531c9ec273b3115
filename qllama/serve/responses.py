"""The JSON of responses and stream chunks, in the shapes the ``openai`` client and lm-eval read.

Every object carries ``model`` (the name asked for), ``system_fingerprint`` (backend,
arithmetic and the file's sha256) and ``qllama`` (the model file's name, sha256, backend,
device, arithmetic and context), so a result can always be traced to what computed it.

Log-probabilities are the model's own (log-softmax of the logits, float64): they do not
depend on temperature, top_k or top_p.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from qllama.serve.engine import Scored
from qllama.serve.models import ModelInfo

DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(kind: str, rid: str, info: ModelInfo, **fields: Any) -> dict[str, Any]:
    """The fields every response and chunk has."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": info.name,
        "system_fingerprint": info.fingerprint,
        **fields,
        "qllama": info.to_dict(),
    }


def sse(data: dict[str, Any]) -> str:
    """One server-sent event frame."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class LegacyLogprobs:
    """Completions' logprobs: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the top ``k``
    and the chosen token, by their text) and ``text_offset`` (characters of the returned text
    before each token), built token by token across stream chunks."""

    def __init__(self, tokenizer: Any, k: int, *, offset: int = 0) -> None:
        self.tok, self.k = tokenizer, k
        self.decoder = tokenizer.decoder()
        self.offset = offset

    def entries(self, pairs: list[tuple[int, Scored | None]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, score in pairs:
            out["tokens"].append(self.tok.token_to_piece(token))
            out["text_offset"].append(self.offset)
            self.offset += len(self.decoder.feed(token))
            if score is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for t, lp in [*score.top[: self.k], (token, score.logprob)]:
                piece = self.tok.token_to_piece(t)
                top[piece] = max(lp, top.get(piece, lp))  # two ids may render alike
            out["token_logprobs"].append(score.logprob)
            out["top_logprobs"].append(top)
        return out


def merge(into: dict[str, list[Any]] | None, more: dict[str, list[Any]]) -> dict[str, list[Any]]:
    if into is None:
        return more
    for key, values in more.items():
        into[key].extend(values)
    return into


def _token_entry(tok: Any, token: int, logprob: float) -> dict[str, Any]:
    return {
        "token": tok.token_to_piece(token),
        "logprob": logprob,
        "bytes": list(tok.token_bytes(token)),
    }


def chat_logprobs(
    tok: Any, pairs: list[tuple[int, Scored | None]], k: int, stop_ids: frozenset[int]
) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries of sampled tokens (end tokens are not content)."""
    out = []
    for token, score in pairs:
        if score is None or token in stop_ids:
            continue
        entry = _token_entry(tok, token, score.logprob)
        entry["top_logprobs"] = [_token_entry(tok, t, lp) for t, lp in score.top[:k]]
        out.append(entry)
    return out
