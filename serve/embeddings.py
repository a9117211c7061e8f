"""/v1/embeddings (OpenAI's), /tokenize and /detokenize (vLLM's) for one AsyncEngine.

An embedding request's inputs are tokenized in the server's preparation pool (never on the event loop), checked
against the context and the vocabulary, admitted as up to a batch of sequences (--max-batch-size: the inputs go
into the engine that many at a time), and computed by the engine without generating: the engine pools their
final hidden states (lmkit.embedding, the model's pooling) and the server normalizes them as the model does. A
client that leaves cancels the inputs not yet computed.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from lmkit.embedding import PoolingConfigError
from lmkit.engine import first_id_outside
from lmkit.serve.admission import Admission
from lmkit.serve.errors import APIError, bad_request
from lmkit.serve.protocol import ChatMessage, Prompt, Text, prompt_items

class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings"""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: Text
    input: Prompt
    """A text, texts (2,048 at most), token ids or lists of them, as a completion's prompt."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    """The first this many values of each vector (Matryoshka models), normalized again where the model
    normalizes."""
    user: Text | None = None

    def inputs(self) -> list[Union[str, list[int]]]:
        """The texts or token-id lists to embed, each non-empty (a 400 naming ``input`` otherwise)."""
        return prompt_items(self.input, "input")


class TokenizeRequest(BaseModel):
    """POST /tokenize: a text (with the tokenizer's special tokens unless told not to) or chat messages
    (rendered by the chat template) as token ids."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids as text (special tokens kept)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: Text | None = None
    tokens: list[int]


class EmbeddingServing:
    """Answers /v1/embeddings, /tokenize and /detokenize next to an OpenAIServing (its engine, model name,
    preparation pool and prompt checks)."""

    def __init__(self, serving, admission: Admission):
        self.serving = serving
        self.engine = serving.engine
        self.admission = admission

    def _check_model(self, name: str | None) -> None:
        if name is not None:
            self.serving.check_model(name)

    # ---- /v1/embeddings ------------------------------------------------------------------------------
    def _prepare(self, req: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids, checked; a 400 naming ``input`` or ``dimensions``."""
        self.serving.check_model(req.model)
        engine = self.engine.engine
        try:
            engine.pooling  # the model's pooling files, read once: a 400 where lmkit cannot follow them
        except PoolingConfigError as e:
            raise APIError(400, f"this model cannot embed: {e}", "model", "invalid_value") from None
        hidden = engine.spec.hidden_size
        if req.dimensions is not None and req.dimensions > hidden:
            raise bad_request(f"dimensions must be at most {hidden} (this model's vectors), got {req.dimensions}",
                              "dimensions")
        ids: list[list[int]] = []
        for i, item in enumerate(req.inputs()):
            item_ids = self.serving.text_ids(item, "input", f"input {i}") if isinstance(item, str) else item
            ids.append(self.serving.checked_ids(item_ids, "input", f"input {i}"))
        return ids

    async def embeddings(self, req: EmbeddingRequest) -> dict:
        self.serving.num_preparing += 1
        try:
            ids = await self.serving.in_pool(self._prepare, req)
        finally:
            self.serving.num_preparing -= 1
        # at most a batch of them in the engine at once, the next as one finishes: any number of inputs fits
        window = min(len(ids), self.admission.max_batch_size)
        reservation = self.admission.admit(window, 1, param="input")
        try:
            vectors = await self.engine.embed(ids, req.dimensions, max_in_flight=window)
        except RuntimeError as e:
            raise APIError(500, str(e), None, "internal_error") from None
        finally:
            reservation.release()
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        num_tokens = sum(len(p) for p in ids)
        return {"object": "list", "data": data, "model": self.serving.model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    # ---- /tokenize, /detokenize ------------------------------------------------------------------------
    def _tokenize(self, req: TokenizeRequest) -> dict:
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt or messages", "prompt")
        engine = self.engine.engine
        tokenizer = engine.tokenizer
        try:
            if req.prompt is not None:
                self.serving.check_num_chars(len(req.prompt), "prompt")
                ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            else:
                self.serving.check_num_chars(sum(m.num_chars for m in req.messages), "messages")
                text = tokenizer.render_chat([m.template_data() for m in req.messages],
                                             add_generation_prompt=req.add_generation_prompt)
                ids = tokenizer.encode(text, add_special_tokens=False)
        except ValueError as e:
            raise bad_request(str(e), "prompt" if req.prompt is not None else "messages") from None
        return {"count": len(ids), "max_model_len": engine.session_len, "tokens": ids}

    def _detokenize(self, req: DetokenizeRequest) -> dict:
        self._check_model(req.model)
        vocab = self.engine.engine.spec.vocab_size
        bad = first_id_outside(req.tokens, vocab)
        if bad is not None:
            raise bad_request(f"tokens has token id {req.tokens[bad]} outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def tokenize(self, req: TokenizeRequest) -> dict:
        return await self.serving.in_pool(self._tokenize, req)

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        return await self.serving.in_pool(self._detokenize, req)


def _encode(vector: np.ndarray, encoding_format: str) -> Union[list[float], str]:
    """A vector as OpenAI writes it: a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
