"""``hf-dspark serve``: an OpenAI-compatible HTTP server in front of the batched DSpark engine.

    GET  /v1/models
    POST /v1/chat/completions     (streamed as server-sent events with ``"stream": true``)
    POST /v1/completions

One thread owns the engine (``EngineWorker``): it admits the requests the HTTP side hands it, steps the engine while
any request is unfinished and passes each step's tokens back to the event loop, so requests join the running batch
as they arrive and the HTTP layer never blocks a step. A client that disconnects aborts its request and frees its
slot; a request that fails finishes alone with an error while the others go on.

Pieces of ``transformers serve`` are reused where they fit: its ASGI middlewares (request ids, cancelling the handler
when the client leaves), its streaming response class, and its conversion of OpenAI messages (text content parts
included) to what a chat template takes; responses are the ``openai`` package's own types, and prompts go through the
tokenizer's chat template. Its request handlers and model manager are not: they run one ``generate()`` per request
(or transformers' continuous batching, which cannot speculate) in a process of their own, where here every request
goes to the one batched engine, which drafts.
"""


import asyncio
import itertools
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from .engine import DSparkEngine, SamplingParams, TokenEvent

DEFAULT_MAX_TOKENS = 1024  # a request without max_tokens gets at most this many (and what its context leaves)
MAX_STOP_SEQUENCES = 4  # as OpenAI's API
# Body fields that would change what is generated and that this server does not implement: refused, never ignored.
UNSUPPORTED_FIELDS = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
                      "logprobs", "top_logprobs", "best_of", "echo", "suffix", "audio", "modalities", "prediction",
                      "reasoning_effort", "web_search_options")
# Body fields that change nothing generated (bookkeeping for the client's side).
PASSIVE_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# ``top_k`` is an extension (as vLLM's); ``generation_config`` is how transformers' own chat client (``transformers
# chat``, through huggingface_hub's InferenceClient) sends its settings: a JSON GenerationConfig diff.
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "n", "stream", "stream_options", "presence_penalty", "frequency_penalty", "generation_config")
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                     "stream_options", "presence_penalty", "frequency_penalty", "generation_config")
# The GenerationConfig fields a request's ``generation_config`` may set, and the body field each stands for.
GENERATION_CONFIG_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                            "top_k": "top_k", "do_sample": None, "transformers_version": None}


class RequestError(ValueError):
    """A request the server refuses: HTTP 400 with an OpenAI-style error body naming ``param``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ------------------------------------------------------------------------------------------------------------------
# The engine thread
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class _Stream:
    """Where one request's events go: an asyncio queue read on ``loop``."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


@dataclass
class Finished:
    """The end of a request's stream: why it ended, its accepted length, and the error when it failed."""

    finish_reason: str
    accepted_length: float | None
    error: str | None = None


class EngineWorker:
    """Owns a ``DSparkEngine`` in one thread. ``submit`` queues a request and returns its id and an asyncio queue of
    ``TokenEvent`` lists ending with a ``Finished``; ``abort`` ends a request early and frees its slot.

    The thread first measures what the engine's first steps would otherwise stop for (``DSparkEngine.prepare``: the
    batched SPS profile, cached per machine): meanwhile ``progress`` says how far it is, requests queue, and
    ``announce`` (a callable taking one line) hears each stage; then ``ready`` is set."""

    def __init__(self, engine: DSparkEngine, announce: Callable[[str], None] | None = None):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf-dspark-engine", daemon=True)
        self._announce = announce or (lambda line: None)
        self.fatal_error: str | None = None
        self.progress: dict | None = None
        self.ready = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    async def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Hand a request to the engine thread; raises the engine's own ``ValueError`` for a request it refuses."""
        if not self.alive:
            raise RuntimeError(f"the engine stopped: {self.fatal_error or 'not running'}")
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self._commands.put(("add", request_id, prompt_ids, params, stream, accepted))
        await accepted  # the engine's add_request ran (or raised) in its thread
        return request_id, stream.events

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- the thread ------------------------------------------------------------------------------------------------
    def _prepare(self) -> None:
        started = time.perf_counter()

        def progress(done: list[int], sizes: list[int], seconds: float) -> None:
            self.progress = {"batch_sizes_measured": len(done), "batch_sizes": len(sizes), "seconds": round(seconds, 1)}
            if not done:
                self._announce(f"measuring the target's verification cost at {len(sizes)} batch sizes "
                               f"({', '.join(map(str, sizes))}; once per machine, dtype and thread count, then cached; "
                               f"about a minute at most); /health says \"profiling\" until it is done")
            else:
                self._announce(f"batch size {done[-1]} measured ({len(done)}/{len(sizes)}, {seconds:.0f} s)")

        self.engine.prepare(progress)
        self.progress = None
        self.ready.set()
        self._announce(f"ready after {time.perf_counter() - started:.1f} s of preparing")

    def _run(self) -> None:
        try:
            self._prepare()
            while not self._stopping.is_set():
                self._take_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
        except BaseException as err:  # noqa: BLE001 - the engine itself broke: every open request hears it
            self.fatal_error = f"{type(err).__name__}: {err}"
            for stream in self._streams.values():
                stream.put(Finished("error", None, self.fatal_error))
            self._streams.clear()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while command is not None:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            if self._streams.pop(command[1], None) is not None:
                self.engine.abort_request(command[1])
            return
        _, request_id, prompt_ids, params, stream, accepted = command
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except ValueError as err:
            stream.loop.call_soon_threadsafe(_set_exception, accepted, RequestError(str(err)))
            return
        self._streams[request_id] = stream
        stream.loop.call_soon_threadsafe(_set_result, accepted, request_id)

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:  # aborted meanwhile
                continue
            stream.put(event)
            if event.finished:
                del self._streams[event.request_id]
                output = self.engine.outputs.get(event.request_id)
                stream.put(Finished(event.finish_reason or "stop",
                                    None if output is None else output.stats.accepted_length,
                                    getattr(event, "error", None)))


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


# ------------------------------------------------------------------------------------------------------------------
# Requests: validation and prompts
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, kind: type, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise RequestError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}", name)
    if high is not None and value > high:
        raise RequestError(f"{name} must be <= {high}, got {value}", name)
    return kind(value)


def _check_fields(body: dict, allowed: tuple[str, ...]) -> None:
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, False, [], {}):
            raise RequestError(f"{name} is not supported by this server", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(f"{name} is not supported by this server (only 0)", name)
    unknown = sorted(set(body) - set(allowed) - set(UNSUPPORTED_FIELDS) - set(PASSIVE_FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(unknown)}", unknown[0])


def _stop_sequences(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise RequestError(f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
    return tuple(stops)


@dataclass
class ModelInfo:
    """What the server serves: its name, tokenizer, context length and end-of-sequence tokens."""

    name: str
    tokenizer: Any
    context_length: int
    eos_token_id: Any = None


def _with_generation_config(body: dict) -> dict:
    """``body`` with its ``generation_config`` (a JSON GenerationConfig diff) read into the fields it stands for;
    the body's own fields win. A setting this server cannot honour is refused, naming it."""
    if body.get("generation_config") is None:
        return body
    try:
        settings = json.loads(body["generation_config"])
    except (TypeError, json.JSONDecodeError):
        raise RequestError("generation_config must be a JSON object in a string", "generation_config") from None
    if not isinstance(settings, dict):
        raise RequestError("generation_config must be a JSON object in a string", "generation_config")
    unsupported = sorted(set(settings) - set(GENERATION_CONFIG_FIELDS))
    if unsupported:
        raise RequestError(f"generation_config sets what this server does not support: {', '.join(unsupported)}",
                           "generation_config")
    merged = {k: v for k, v in body.items() if k != "generation_config"}
    for name, field in GENERATION_CONFIG_FIELDS.items():
        if field is not None and name in settings and merged.get(field) is None:
            merged[field] = settings[name]
    if settings.get("do_sample") is False and body.get("temperature") is None:
        merged["temperature"] = 0.0
    return merged


def parse_request(body: Any, model: ModelInfo, prompt_ids: Callable[[dict], list[int]],
                  allowed: tuple[str, ...]) -> ParsedRequest:
    """Validate an OpenAI request body and turn it into the engine's prompt ids and ``SamplingParams``."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_fields(body, allowed)
    body = _with_generation_config(body)
    if body.get("model") not in (None, model.name):
        raise RequestError(f"unknown model {body.get('model')!r}; this server serves {model.name!r}", "model")
    if _number(body, "n", int, 1, 1) not in (None, 1):
        raise RequestError("n must be 1", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("stream_options takes only include_usage", "stream_options")
    temperature = _number(body, "temperature", float, 0.0, 2.0)
    top_p = _number(body, "top_p", float, 0.0, 1.0, low_open=True)
    top_k = _number(body, "top_k", int, 1)
    seed = _number(body, "seed", int)
    ids = prompt_ids(body)
    room = model.context_length - len(ids)
    if room < 1:
        raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {model.context_length}",
                           "messages" if "messages" in body else "prompt")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, int, 1)
    if max_tokens is not None and max_tokens > room:
        raise RequestError(f"{name}={max_tokens} does not fit: the prompt has {len(ids)} tokens and the model's "
                           f"context is {model.context_length}", name)
    temperature = 1.0 if temperature is None else temperature  # OpenAI's defaults
    params = SamplingParams(max_new_tokens=max_tokens or min(DEFAULT_MAX_TOKENS, room), do_sample=temperature > 0,
                            temperature=temperature if temperature > 0 else 1.0,
                            top_p=top_p if temperature > 0 and top_p is not None and top_p < 1 else None,
                            top_k=top_k if temperature > 0 else None, stop_strings=_stop_sequences(body), seed=seed)
    return ParsedRequest(ids, params, params.stop_strings, stream, bool(options.get("include_usage")))


def chat_prompt_ids(tokenizer) -> Callable[[dict], list[int]]:
    """A chat request's messages through the tokenizer's chat template (content parts read as transformers serve
    reads them)."""
    from transformers.cli.serving.utils import BaseHandler, Modality

    def encode(body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a role", "messages")
            content = message.get("content")
            if not isinstance(content, (str, list)) or (isinstance(content, list) and not all(
                    isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    for part in content)):
                raise RequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")
        converted = BaseHandler.get_processor_inputs_from_messages(messages, Modality.LLM)
        ids = tokenizer.apply_chat_template(converted, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    return encode


def completion_prompt_ids(tokenizer) -> Callable[[dict], list[int]]:
    """A completion request's prompt: a string, a list holding one string, or a list of token ids."""

    def encode(body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise RequestError("prompt must be a non-empty string, a list of one string, or a list of token ids",
                           "prompt")

    return encode


# ------------------------------------------------------------------------------------------------------------------
# Text out of tokens
# ------------------------------------------------------------------------------------------------------------------
class TextStream:
    """A request's text as its tokens arrive (``tokenizers``' ``DecodeStream``), with stop sequences cut out as
    OpenAI's API does: the text ends before the first stop sequence, and a tail that could still become one is
    held back until the next tokens or the end."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
        self._decoder = DecodeStream(skip_special_tokens=True)
        self.stop = stop
        self.text = ""  # decoded so far
        self.sent = 0  # characters of ``text`` already handed out: ``text[:sent]`` is the answer so far
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        for token_id in token_ids:
            piece = self._decoder.step(self._tokenizer, token_id)
            if piece:
                self.text += piece
        return self._release(final=False)

    def finish(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        cuts = [i for i in (self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop) if i >= 0]
        if cuts:
            end, self.stopped = min(cuts), True
        elif not final and self.stop:  # a stop sequence may be starting at the end of the text
            hold = max(len(s) - 1 for s in self.stop)
            end = max(self.sent, end - hold)
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


def openai_finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


# ------------------------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------------------------
def build_app(worker: EngineWorker, model: ModelInfo):
    """The FastAPI app serving ``model`` through ``worker``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from transformers.cli.serving.utils import CancelOnDisconnect, EventStream, RequestIdMiddleware

    app = FastAPI(title="hf-dspark serve")
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(CancelOnDisconnect)
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def _refused(_request, err: RequestError):
        return JSONResponse(error_body(str(err), param=err.param), status_code=400)

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse({"status": "unhealthy", "reason": worker.fatal_error}, status_code=503)
        if not worker.ready.is_set():  # requests are taken and queue until the profile is measured
            return JSONResponse({"status": "profiling", "progress": worker.progress}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": created,
                                             "owned_by": "hf-dspark"}]}

    async def read_body(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"the request body is not valid JSON: {err}") from None

    async def handle(request: Request, chat: bool):
        body = await read_body(request)
        encode = chat_prompt_ids(model.tokenizer) if chat else completion_prompt_ids(model.tokenizer)
        parsed = parse_request(body, model, encode, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        if not worker.alive:
            return JSONResponse(error_body(f"the engine stopped: {worker.fatal_error}", "server_error"), 503)
        request_id, events = await worker.submit(parsed.prompt_ids, parsed.params)
        response = ChatResponses(model.name, request_id) if chat else CompletionResponses(model.name, request_id)
        text = TextStream(model.tokenizer, parsed.stop)
        if parsed.stream:
            return EventStream(_stream(worker, request_id, events, text, response, parsed, len(parsed.prompt_ids)),
                               media_type="text/event-stream")
        return await _complete(worker, request_id, events, text, response, len(parsed.prompt_ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    return app


def usage(prompt_tokens: int, completion_tokens: int, finished: Finished) -> dict:
    """OpenAI's usage, plus the request's accepted length (tokens per target forward)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "accepted_length": finished.accepted_length}


class ChatResponses:
    """Chat completion objects and chunks (the ``openai`` package's types)."""

    def __init__(self, model: str, request_id: str):
        self.model, self.id, self.created = model, f"chatcmpl-{request_id}", int(time.time())

    def whole(self, text: str, finish_reason: str, usage_: dict) -> dict:
        from openai.types.chat import ChatCompletion

        return ChatCompletion.model_validate({
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason}],
            "usage": usage_}).model_dump(exclude_none=True)

    def chunk(self, delta: dict | None = None, finish_reason: str | None = None, usage_: dict | None = None) -> str:
        from openai.types.chat import ChatCompletionChunk

        choices = [] if usage_ is not None else [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason}]
        chunk = ChatCompletionChunk.model_validate({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": choices, "usage": usage_})
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    def first(self) -> str:
        return self.chunk({"role": "assistant", "content": ""})

    def text(self, text: str) -> str:
        return self.chunk({"content": text})


class CompletionResponses:
    """Completion objects and chunks (the ``openai`` package's types)."""

    def __init__(self, model: str, request_id: str):
        self.model, self.id, self.created = model, f"cmpl-{request_id}", int(time.time())

    def _object(self, text: str, finish_reason: str | None, usage_: dict | None) -> Any:
        from openai.types import Completion

        return Completion.model_validate({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason or "stop", "logprobs": None}],
            "usage": usage_})

    def whole(self, text: str, finish_reason: str, usage_: dict) -> dict:
        return self._object(text, finish_reason, usage_).model_dump(exclude_none=True)

    def chunk(self, text: str = "", finish_reason: str | None = None, usage_: dict | None = None) -> str:
        data = self._object(text, finish_reason, usage_).model_dump(exclude_none=True)
        if usage_ is not None:  # the usage chunk, the last one, carries no choice (as chat's)
            data["choices"] = []
        elif finish_reason is None:
            data["choices"][0]["finish_reason"] = None  # a chunk before the last: not finished yet
        return f"data: {json.dumps(data)}\n\n"

    def first(self) -> str | None:
        return None

    def text(self, text: str) -> str:
        return self.chunk(text)


async def _events(worker: EngineWorker, request_id: str, events: asyncio.Queue) -> AsyncIterator[Any]:
    """A request's ``TokenEvent``s, then its ``Finished``; the request is aborted if the reader goes away first."""
    finished = False
    try:
        while True:
            item = await events.get()
            yield item
            if isinstance(item, Finished):
                finished = True
                return
    finally:
        if not finished:
            worker.abort(request_id)


async def _complete(worker, request_id, events, text: TextStream, response, prompt_tokens: int):
    from fastapi.responses import JSONResponse

    tokens = 0
    async for item in _events(worker, request_id, events):
        if isinstance(item, Finished):
            if item.error is not None:
                return JSONResponse(error_body(f"the request failed: {item.error}", "server_error"), 500)
            text.finish()
            return JSONResponse(response.whole(text.text[: text.sent], openai_finish_reason(item.finish_reason),
                                               usage(prompt_tokens, tokens, item)))
        tokens += len(item.token_ids)
        text.add(item.token_ids)
    raise RuntimeError("a request's events ended without its end")  # pragma: no cover - _events always finishes


async def _stream(worker, request_id, events, text: TextStream, response, parsed: ParsedRequest,
                  prompt_tokens: int) -> AsyncIterator[str]:
    first = response.first()
    if first:
        yield first
    tokens = 0
    async for item in _events(worker, request_id, events):
        if isinstance(item, Finished):
            if item.error is not None:
                yield f"data: {json.dumps(error_body(f'the request failed: {item.error}', 'server_error'))}\n\n"
                return
            tail = text.finish()
            if tail:
                yield response.text(tail)
            yield response.chunk(finish_reason=openai_finish_reason(item.finish_reason))
            if parsed.include_usage:
                yield response.chunk(usage_=usage(prompt_tokens, tokens, item))
            yield "data: [DONE]\n\n"
            return
        tokens += len(item.token_ids)
        delta = text.add(item.token_ids)
        if delta:
            yield response.text(delta)


# ------------------------------------------------------------------------------------------------------------------
# Running it
# ------------------------------------------------------------------------------------------------------------------
def context_length(target, tokenizer) -> int:
    """The target's context: ``max_position_embeddings`` of its text config, else the tokenizer's limit."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    length = getattr(config, "max_position_embeddings", None)
    if length is None:
        length = getattr(tokenizer, "model_max_length", None)
    if not length or length > 10**7:
        raise ValueError("cannot tell the target's context length (no max_position_embeddings)")
    return int(length)


def serve(target, tokenizer, drafter, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", announce: Callable[[str], None] | None = None, **engine_kwargs) -> None:
    """Serve until interrupted (uvicorn, one worker: the engine is in this process). ``announce`` hears the
    engine's preparation and readiness (``EngineWorker``)."""
    import uvicorn

    engine = DSparkEngine(target, drafter, tokenizer=tokenizer, **engine_kwargs)
    worker = EngineWorker(engine, announce)
    worker.start()
    app = build_app(worker, ModelInfo(model_name, tokenizer, context_length(target, tokenizer)))
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        worker.stop()


__all__ = ["EngineWorker", "Finished", "ModelInfo", "RequestError", "TextStream", "build_app", "parse_request",
           "serve"]
