"""The HTTP side (starlette): OpenAI's /v1/chat/completions and /v1/completions, streamed or not, /v1/models
and /health. A handler checks the request, encodes its prompt with the model's own chat template, queues it
with the engine worker and relays what the worker posts; it never runs the model itself."""
from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass, field

from jinja2 import TemplateError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from offload import Tokenizer
from runtime.sampling_defaults import SamplingDefaults
from .config import ServeConfig
from .errors import HANDLERS, ApiError
from .responses import Shape, sse
from .schemas import Completion, parse_json, parse_request
from .worker import EngineWorker, Failed, Finished, Job, Refused, Ticket

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class Served:
    """What the handlers serve: the worker, the model's tokenizer and limits, and the request defaults."""
    worker: EngineWorker
    tokenizer: Tokenizer
    model_name: str
    max_context: int
    vocab_size: int
    config: ServeConfig
    defaults: SamplingDefaults = field(default_factory=lambda: SamplingDefaults({}))
    explicit: dict = field(default_factory=dict)         # the sampling flags given to `serve`
    default_stop: list[str] = field(default_factory=list)


def build_app(served: Served) -> Starlette:
    async def chat(request: Request) -> Response:
        return await _complete(served, request, "chat")

    async def completions(request: Request) -> Response:
        return await _complete(served, request, "completion")

    async def models(request: Request) -> Response:
        _authorize(request, served.config.api_key)
        return JSONResponse({"object": "list", "data": [_model_card(served)]})

    async def model(request: Request) -> Response:
        _authorize(request, served.config.api_key)
        _check_model(served, request.path_params["name"])
        return JSONResponse(_model_card(served))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": served.model_name, **served.worker.status()})

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers=HANDLERS)


async def _complete(served: Served, request: Request, kind: str) -> Response:
    _authorize(request, served.config.api_key)
    body = parse_json(await _read_body(request, served.config.max_body_bytes))
    completion = parse_request(kind, body, served.config.max_new_tokens)
    _check_model(served, completion.model)
    try:
        ticket = served.worker.submit(_job(served, completion))
    except Refused as refused:
        raise ApiError(refused.status, str(refused), code="queue_full" if refused.status == 429 else None) from None
    shape = Shape(kind, served.model_name, completion.include_usage)
    if completion.stream:
        return StreamingResponse(_stream(served.worker, ticket, shape), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    outcome = await _outcome_unless_gone(served.worker, ticket, request)
    if outcome is None:
        return Response(status_code=499)          # nobody reads it: the client went away
    if isinstance(outcome, Failed):
        raise ApiError(outcome.status, outcome.message)
    return JSONResponse(shape.body(outcome))


def _job(served: Served, completion: Completion) -> Job:
    prompt_ids, param = _prompt_ids(served, completion)
    if len(prompt_ids) >= served.max_context:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the context holds {served.max_context} "
                            "(the server's --context), and at least one must be left to answer",
                       param=param, code="context_length_exceeded")
    try:
        sampling = served.defaults.resolve({**served.explicit, **completion.sampling})
    except ValueError as err:
        raise ApiError(400, str(err)) from None
    return Job(prompt_ids, sampling, completion.max_tokens or served.config.max_new_tokens,
               completion.stop or served.default_stop)


def _prompt_ids(served: Served, completion: Completion) -> tuple[list[int], str]:
    if completion.messages is not None:
        try:
            return served.tokenizer.encode_chat(completion.messages), "messages"
        except (TemplateError, ValueError) as err:    # the model's template refuses the conversation
            raise ApiError(400, f"the model's chat template refuses these messages: {err}", "messages") from None
    if isinstance(completion.prompt, str):      # with the tokenizer's own specials (a BOS where it adds one)
        return served.tokenizer.encode(completion.prompt, add_special_tokens=True), "prompt"
    if max(completion.prompt) >= served.vocab_size:
        raise ApiError(400, f"token id {max(completion.prompt)} is outside the vocabulary (size "
                            f"{served.vocab_size})", "prompt")
    return list(completion.prompt), "prompt"


async def _stream(worker: EngineWorker, ticket: Ticket, shape: Shape):
    """Server-sent events until the answer ends; an error chunk if the engine fails or the server stops. A
    client that goes away cancels this generator (starlette listens for the disconnect): the request leaves
    its slot after the pass in progress."""
    try:
        if shape.kind == "chat":
            yield shape.chunk(first=True)
        while True:
            event = await ticket.events.get()
            if isinstance(event, str):
                yield shape.chunk(event)
            elif isinstance(event, Finished):
                yield shape.ending(event)
                return
            else:
                yield sse(ApiError(event.status, event.message).body())
                return
    finally:
        if not ticket.is_done:
            worker.cancel(ticket)


async def _outcome_unless_gone(worker: EngineWorker, ticket: Ticket, request: Request) -> Finished | Failed | None:
    """The request's end, or None when its client disconnected first (the request is then cancelled)."""
    outcome, gone = asyncio.ensure_future(ticket.outcome()), asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({outcome, gone}, return_when=asyncio.FIRST_COMPLETED)
    for task in (outcome, gone):
        task.cancel()
    if outcome.done() and not outcome.cancelled():
        return outcome.result()
    worker.cancel(ticket)
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"the request body is over {limit} bytes (the server's --max-body)")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def _authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the "
                            "server's --api-key", code="invalid_api_key")


def _check_model(served: Served, name: str) -> None:
    if name != served.model_name:
        raise ApiError(404, f"the model {name!r} does not exist here; this server serves {served.model_name!r}",
                       param="model", code="model_not_found")


def _model_card(served: Served) -> dict:
    return {"id": served.model_name, "object": "model", "created": 0, "owned_by": "specstream",
            "context_length": served.max_context}
