"""Serving translations over HTTP: a JSON API with dynamic batching, OpenAPI docs and an attention page.

One model instance answers every request; ``qkv.serve.api`` says what a request may ask for (beam,
n-best lists with scores, sampling, attention), ``qkv.serve.batcher`` forms the batches. Every request is
bounded before it is queued: its body (``max_body_bytes``, checked while it arrives), its texts, its
work (``max_request_work``: its source and output tokens and, with attention, the weights it
computes; ``qkv.serve.batcher``) and, with attention, the number of weights it can return
(``max_attention_weights``). Limits answer JSON 4xx errors that name the limit; a full queue answers
503 with Retry-After; a request waits at most ``request_timeout`` seconds (504). A client that
disconnects is noticed while its request waits, and its work is dropped.

Endpoints: ``POST /v1/translate``, ``GET /v1/model``, ``GET /v1/stats``, ``GET /health``, the page at
``/`` and FastAPI's ``/docs`` and ``/openapi.json``. Note: no ``from __future__ import annotations``
here, because FastAPI reads the request model from the endpoint's annotations at run time.
"""

import asyncio
import copy
import errno
import json
import logging
import socket
import threading
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qkv.errors import QkvError
from qkv.data.sentences import TextOptions, prepare_line
from qkv.io import checkpoint
from qkv.inspect.trust import calibration_of
from qkv.document.segments import PLACEHOLDER
from qkv.serve.batcher import Batcher, Busy, Job
from qkv.serve.documents import DocumentTranslator
from qkv.serve.work import (
    ATTENTION_WEIGHTS_PER_UNIT, CONTRIBUTION_ELEMENTS_PER_UNIT, CONTRIBUTION_TEXT_WORK, GLOSSARY_CHARS_PER_UNIT, GLOSSARY_ENTRY_WORK,
    GLOSSARY_MATCHES_PER_UNIT, SAMPLED_TOKEN_WORK, SOURCE_TOKEN_WORK, TOP_K_TOKEN_WORK, TOP_P_TOKEN_WORK, Settings, Work,
)
from qkv.serve.api import ErrorOut, InvalidOptions, TranslateResponse, request_model, settings_of

log = logging.getLogger("qkv.serve.app")

RETRY_AFTER_S = 1  # what a 503 tells clients to wait

# Defaults of `qkv serve`, in one place for the CLI and the library.
DEFAULT_LIMITS: dict[str, Any] = dict(
    max_batch_sentences=32,
    max_batch_tokens=4096,
    max_wait_ms=10.0,
    max_queue=256,
    max_texts=64,
    max_chars=1000,
    max_body_bytes=1 << 20,  # 64 texts of 1000 characters, even escaped as \\uXXXX pairs, fit
    max_request_work=20_000,  # source + beam x output tokens: 64 short sentences at beam 5, or one long at beam 16
    max_queue_work=200_000,  # ten of the largest requests
    max_attention_weights=1_000_000,  # about 7 MB of JSON
    request_timeout=60.0,
)


class BodyTooLarge(HTTPException):
    """Raised while a body arrives, as soon as it passes the limit (FastAPI lets HTTPException through)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than this server's limit of {limit} bytes (--max-body-bytes)")


class BodyLimit:
    """ASGI middleware: answer 413 before a too-large body is buffered or parsed. A declared
    Content-Length is checked before anything is read; a chunked body is counted as it arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        received, started = 0, False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyTooLarge:  # only if no handler answered it on the way out
            if started:
                raise
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        await _body_too_large_response(BodyTooLarge(self.max_bytes))({"type": "http"}, _nothing_to_receive, send)


def _body_too_large_response(error: BodyTooLarge) -> JSONResponse:
    # Connection: close, so that the server reads no more of a body it has refused.
    return JSONResponse({"detail": error.detail}, 413, {"connection": "close"})


async def _body_too_large(request: Request, error: BodyTooLarge) -> JSONResponse:
    return _body_too_large_response(error)


async def _nothing_to_receive() -> Message:
    return {"type": "http.disconnect"}


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away. After the body, the server's receive() waits for that."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EscapedJSON(JSONResponse):
    """JSON with non-ASCII escaped, so an error that quotes a lone surrogate still renders (no 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


async def _invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 (each problem's location, type and message) without echoing the input back."""
    problems = []
    for e in error.errors():
        problem = {k: v for k, v in e.items() if k not in ("input", "ctx")}
        if "ctx" in e:  # a validator's exception object becomes its message
            problem["ctx"] = {k: str(v) if isinstance(v, Exception) else v for k, v in e["ctx"].items()}
        problems.append(problem)
    return _EscapedJSON({"detail": jsonable_encoder(problems)}, 422)


def model_info(loaded: checkpoint.Checkpoint) -> dict[str, Any]:
    """What ``GET /v1/model`` answers: languages, sizes, vocabulary and the checkpoint's identity."""
    data = loaded.config.get("data") or {}
    config = loaded.model.config
    return {
        "src_lang": data.get("src_lang"),
        "tgt_lang": data.get("tgt_lang"),
        "checkpoint": loaded.path.resolve().name,  # the directory's name: where it lies on the server is no client's business
        "sha256": checkpoint.sha256(loaded.path / checkpoint.WEIGHTS)[:16],  # of model.safetensors
        "parameters": loaded.model.num_parameters(),
        "vocab_size": loaded.tokenizer.vocab_size,
        "d_model": config.d_model,
        "n_heads": config.n_heads,
        "d_ff": config.d_ff,
        "n_encoder_layers": config.n_encoder_layers,
        "n_decoder_layers": config.n_decoder_layers,
        "max_len": config.max_len,
        "model": config.to_dict(),
    }


ENGINES = ("qkv", "ctranslate2")
BATCHING = ("continuous", "batches")  # qkv serve --batching: how qkv's engine groups beam searches (create_app)


def _ct2_translators(loaded: checkpoint.Checkpoint):
    """``Batcher``'s make_translator for --engine ctranslate2: one CTranslate2 model for every batch; the
    first batch of a new export checks it against qkv's search (``qkv.interop.ct2_engine``)."""
    from qkv.interop.ct2_engine import CTranslate2Translator, ensure_export

    ct2_dir, fresh = ensure_export(loaded.path, log=log.info)
    parity = {"pending": fresh, "failed": None}  # shared: a failed check fails every later batch too
    engine = None
    lock = threading.Lock()  # model threads make Translators at once: one loads the model, the others reuse it

    def make(config, **kwargs):
        nonlocal engine
        with lock:
            translator = CTranslate2Translator(loaded.model, loaded.tokenizer, config, ct2_dir=ct2_dir, check=parity,
                                               engine=engine, log=log.info, **kwargs)
            engine = translator.engine
        return translator

    return make


# How the work of a request is counted, for the API's description and the 422 that refuses too much.
WORK_RULES = (
    f"a unit is one decoder step of one output token. Per text: {SOURCE_TOKEN_WORK} per source token for each pass "
    "of the encoder over it (the search; one more to score a greedy or sampled output; one more each for attention "
    "and confidence), "
    f"plus the most output tokens x what one costs (the beam size; with sampling {SAMPLED_TOKEN_WORK}, "
    f"{TOP_K_TOKEN_WORK} with top_k, {TOP_P_TOKEN_WORK} with top_p; 1 more to score a greedy or sampled output); "
    f"with attention, also 1 per {ATTENTION_WEIGHTS_PER_UNIT} attention weights computed (encoder, decoder and "
    "cross, layers x heads x positions x positions); with attention and with confidence, each, the output tokens once "
    f"more, {CONTRIBUTION_TEXT_WORK} a text and 1 per {CONTRIBUTION_ELEMENTS_PER_UNIT} elements of the vectors that "
    "decompose each attention block (layers x positions x positions x d_model); "
    f"with a glossary, {GLOSSARY_ENTRY_WORK} per entry, 1 per {GLOSSARY_CHARS_PER_UNIT} characters of its source terms "
    f"and 1 per {GLOSSARY_MATCHES_PER_UNIT} entries x text characters, and for a text that holds terms its constrained "
    "search; a text cut into sentences counts each sentence as a text; an empty text counts 1"
)


def kept_as_text(body) -> bool:
    """Whether a request of texts without a format is translated as ``format: "text"``: one of its texts holds a
    placeholder (``qkv.document.segments.PLACEHOLDER``: a URL, an e-mail address, ``%s``, ``{name}``, an emoji) or
    a tab, and it asks for nothing the text format does not give (n_best, sampling, attention, max_length,
    confidence, a glossary, numbers), as ``qkv translate`` keeps plain lines (``qkv.cli.document.text_format_writer``)."""
    if body.n_best is not None or body.sampling or body.attention or body.max_length is not None or body.confidence:
        return False
    if body.glossary is not None or body.numbers:
        return False
    return any("\t" in text or PLACEHOLDER.search(text) for text in body.texts)


def too_much_work(work: Work, settings: Settings, limit: int) -> str:
    """The 422's message: the request's units, part by part, and what to change."""
    parts = f"{work.source} for source tokens, {work.output} for output tokens"
    if settings.attention:
        parts += f", {work.attention} for attention weights"
    if settings.attention or settings.confidence:
        parts += f", {work.contributions} for contributions"
    if settings.glossary is not None:
        parts += f", {work.glossary} for the glossary"
    return (
        f"this request asks for {work.total} units of work ({parts}; {WORK_RULES}); this server's limit is {limit} "
        "(--max-request-work): send fewer or shorter texts, a smaller beam_size or a max_length"
    )


def page_html() -> str:
    return resources.files("qkv.serve").joinpath("server.html").read_text(encoding="utf-8")


def _unprocessable(field: str, kind: str, message: str) -> JSONResponse:
    # The shape of FastAPI's own 422, so that clients (and the page) read limits and invalid combinations alike.
    return JSONResponse({"detail": [{"loc": ["body", field], "type": kind, "msg": message}]}, 422)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status, headers)


def create_app(
    checkpoint_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    loop_guard: int = 0, engine: str = "qkv", searches: int = 1, batching: str = "batches", **overrides: Any
) -> FastAPI:
    """Load the checkpoint onto ``device`` (errors surface here, before any port is bound) and build
    the app. ``overrides`` replace entries of ``DEFAULT_LIMITS``. With ``dtype`` bfloat16 the searches
    run on a bfloat16 copy of the model (``qkv.model.bf16``); confidence and attention read the float32 one.
    ``loop_guard``: every search's ``DecodeConfig.loop_guard`` (0, the default here: the exact search;
    ``qkv serve`` passes its ``--loop-guard``, 2 unless told). ``engine`` "ctranslate2": CTranslate2 searches
    (``qkv.interop.ct2_engine``: the checkpoint's export, made once into qkv's cache and checked on the
    first batch), for beam search and greedy search only. ``searches``: batches searched at once, each in
    its own model thread (``qkv.serve.batcher``; ``serve`` chooses it for the machine). ``batching``
    "continuous": on qkv's engine, beam searches without a glossary are searched in lanes that
    sentences join and leave at every step (``qkv.serve.lanes``); "batches" (the default): every request in
    batches (on 2 CPU cores the continuous search was no faster: docs/serving.md)."""
    if engine not in ENGINES:
        raise QkvError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
    if batching not in BATCHING:
        raise QkvError(f"unknown batching {batching!r}: one of {', '.join(BATCHING)}")
    if engine == "ctranslate2" and (dtype != torch.float32 or torch.device(device).type != "cpu"):
        raise QkvError("--engine ctranslate2 runs on the CPU in float32: not with --bf16 or --device cuda")
    unknown = set(overrides) - set(DEFAULT_LIMITS)
    if unknown:
        raise QkvError(f"unknown server limits: {', '.join(sorted(unknown))}")
    limits = {**DEFAULT_LIMITS, **overrides}
    for name, value in limits.items():
        if name != "max_wait_ms" and not value > 0:
            raise QkvError(f"{name} must be positive, got {value}")
    if limits["max_wait_ms"] < 0:
        raise QkvError(f"max_wait_ms must be >= 0, got {limits['max_wait_ms']}")
    if limits["max_queue_work"] < limits["max_request_work"]:
        raise QkvError("max_queue_work must be at least max_request_work, or the largest request never fits")
    loaded = checkpoint.load(checkpoint_dir, device=device)
    info = model_info(loaded)
    tokenizer, max_src = loaded.tokenizer, loaded.model.config.max_len - 1
    search_model = loaded.model if dtype == torch.float32 else copy.deepcopy(loaded.model).to(dtype)
    make_translator = None
    if engine == "ctranslate2":
        make_translator = _ct2_translators(loaded)
    batcher = Batcher(
        loaded.model, tokenizer, search_model=search_model, make_translator=make_translator, max_batch_sentences=limits["max_batch_sentences"],
        max_batch_tokens=limits["max_batch_tokens"], max_batch_work=limits["max_request_work"],
        max_wait_ms=limits["max_wait_ms"], max_queue=limits["max_queue"], max_queue_work=limits["max_queue_work"],
        calibration=calibration_of(loaded.path), loop_guard=loop_guard, searches=searches,
        continuous=engine == "qkv" and batching == "continuous",
        **checkpoint.decode_defaults(loaded.config),
    )
    src_lang = info["src_lang"] or "en"  # whose rules cut a text into sentences (unknown: English's)
    TranslateRequest = request_model(
        max_texts=limits["max_texts"], max_chars=limits["max_chars"], max_output=max_src, vocab_size=tokenizer.vocab_size
    )
    max_work, max_weights, timeout = limits["max_request_work"], limits["max_attention_weights"], limits["request_timeout"]
    documents = DocumentTranslator(batcher, src_lang=src_lang, tgt_lang=info["tgt_lang"], calibration=batcher.calibration)
    page = page_html()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        # uvicorn calls this once requests in flight are answered or, after --graceful-timeout, given up.
        await batcher.close()

    errors = {status: {"model": ErrorOut, "description": text} for status, text in ERRORS.items()}
    app = FastAPI(
        title="qkv translation server",
        version="1",
        description=(
            f"Transformer translation ({info['src_lang']} -> {info['tgt_lang']}) with dynamic batching.\n\n"
            f"Limits: at most {limits['max_texts']} texts of {limits['max_chars']} characters; "
            f"{max_work} units of work a request (422 above), and {limits['max_queue_work']} waiting (503 above); "
            f"with attention, at most {max_weights} weights returned (layers x heads x output x source tokens). "
            f"Work: {WORK_RULES}."
        ),
        lifespan=lifespan,
        exception_handlers={RequestValidationError: _invalid_request, BodyTooLarge: _body_too_large},
    )
    app.add_middleware(BodyLimit, max_bytes=limits["max_body_bytes"])
    app.state.batcher = batcher

    @app.post("/v1/translate", response_model=TranslateResponse, response_model_exclude_none=True, responses=errors)
    async def translate(request: Request, body: TranslateRequest):  # type: ignore[valid-type]
        """Translate texts, in order; with `n_best`, also each text's n best translations and their scores;
        with `sampling`, draw translations at random (reproducibly under `seed`); with `attention`, also
        each output's cross-attention, contributions and tokens; with `confidence`, whether to trust each
        translation (a confidence from 0 to 1, flags and per-word marks)."""
        try:
            settings = settings_of(body)
        except InvalidOptions as invalid:
            return _unprocessable(invalid.field, "invalid_combination", str(invalid))
        if engine == "ctranslate2" and (settings.sampling or (settings.n_best or 1) > 1):
            field = "sampling" if settings.sampling else "n_best"
            return _unprocessable(field, "not_on_this_engine",
                                  f"this server searches with CTranslate2 (--engine ctranslate2): no {field}; ask a qkv-engine server")
        if body.format is not None:
            return await _document(body, settings)
        if kept_as_text(body):  # as qkv translate's plain lines: a URL or an emoji the model would rewrite or drop
            return await _document(body.model_copy(update={"format": "text"}), settings)
        lines = None  # with split or recasing: each text's sentences (qkv.data.sentences), searched apart and joined
        whole = body.max_length is not None  # n_best, a glossary and numbers: cut as the command cuts them
        options = None
        try:  # any failure here (the splitter, the tokenizer) is a JSON 500 counted in /v1/stats, as the batcher's
            if (body.split or not body.keep_case) and not whole:
                options = TextOptions(split=src_lang if body.split else None, recase=not body.keep_case)
                lines = [prepare_line(text, options) for text in body.texts]
            texts = body.texts if lines is None else [s for line in lines for s in line.sentences]
            src_ids = [ids[:max_src] for ids in tokenizer.encode_batch(texts)]
            # The answer's size first: over it, attention is what to change (its weights also count as work).
            if body.attention and (weights := batcher.attention_weights(src_ids, settings)) > max_weights:
                return _unprocessable("attention", "too_much_attention", (
                    f"with attention this request could return {weights} weights (layers x heads x output x source "
                    f"tokens, summed over sentences); this server's limit is {max_weights} (--max-attention-weights): "
                    "send fewer or shorter texts, or a max_length"
                ))
            parts = batcher.work_parts(src_ids, settings, texts)  # a glossary's own work by its size: nothing matched here
            if parts.total > max_work:
                return _unprocessable("texts", "too_much_work", too_much_work(parts, settings, max_work))
            if settings.glossary is not None:  # its terms matched in the model thread, for the constrained searches' charge
                parts = await batcher.glossary_work(src_ids, settings, texts, reserve=parts.total)
                if parts.total > max_work:
                    return _unprocessable("texts", "too_much_work", too_much_work(parts, settings, max_work))
            job = batcher.submit(body.texts, src_ids, settings, parts.total, lines=lines, text=options)
        except Busy as busy:
            return _error(503, f"server busy: {busy}; retry later", {"Retry-After": str(RETRY_AFTER_S)})
        except Exception:  # a bug or a third-party library's failure: the client gets JSON, the log the traceback
            log.exception("preparing a request of %d texts failed", len(body.texts))
            batcher.stats.failed += 1
            return _error(500, "preparing the translation failed; the server's log has the details")
        return await _answer(request, job)

    async def _document(body, settings) -> Response:
        """Documents (qkv.serve.documents): read and charged before any search, then translated whole."""
        if refused := documents.refusal(body):
            return _unprocessable(refused[0], "not_with_format", refused[1])
        try:
            parsed = documents.read(body)  # once: these documents are the ones translated
            segments = [segment.text for document in parsed for segment in document.segments]
        except QkvError as error:
            return _unprocessable("texts", "bad_document", str(error))
        except Exception:  # a bug or a parser's failure: the client gets JSON, the log the traceback
            log.exception("reading a request of %d documents failed", len(body.texts))
            batcher.stats.failed += 1
            return _error(500, "reading the document failed; the server's log has the details")
        src_ids = [ids[:max_src] for ids in tokenizer.encode_batch(segments)] if segments else []
        parts = batcher.work_parts(src_ids, settings, segments)
        if parts.total > max_work:
            return _unprocessable("texts", "too_much_work", too_much_work(parts, settings, max_work))
        try:
            answer = await asyncio.wait_for(documents.translate(body, settings, parsed), timeout)
        except asyncio.TimeoutError:
            batcher.stats.timed_out += 1
            return _error(504, f"translation took longer than this server's limit of {timeout:g} s (--request-timeout)")
        except QkvError as error:
            return _unprocessable("texts", "bad_document", str(error))
        except Exception:
            log.exception("translating a request of %d documents failed", len(body.texts))
            batcher.stats.failed += 1
            return _error(500, "translation failed; the server's log has the details")
        return JSONResponse(answer)

    async def _answer(request: Request, job: Job) -> Response:
        """Wait for the job's JSON, the client's disconnect or the timeout, whichever comes first."""
        gone = asyncio.create_task(_disconnected(request))
        try:
            done, _ = await asyncio.wait({job.future, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs after --graceful-timeout: say so (not a bare 500) and stop.
            return _error(503, "the server is shutting down; retry later", {"Retry-After": str(RETRY_AFTER_S)})
        finally:
            gone.cancel()
            job.future.cancel()  # a no-op once answered; otherwise the batcher drops or stops its work
        if job.future in done and not job.future.cancelled():
            try:
                return Response(job.future.result(), media_type="application/json")
            except Busy as busy:
                return _error(503, f"server busy: {busy}; retry later", {"Retry-After": str(RETRY_AFTER_S)})
            except RuntimeError:
                return _error(500, "translation failed; the server's log has the details")
        if gone in done:
            batcher.stats.cancelled += 1
            return Response(status_code=499)  # nobody reads it: the client has gone
        batcher.stats.timed_out += 1
        return _error(504, f"translation took longer than this server's limit of {timeout:g} s (--request-timeout)")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "queue": batcher.queue_depth()}

    @app.get("/v1/model")
    async def model() -> dict[str, Any]:
        """Languages, sizes, vocabulary size, parameter count and the checkpoint's directory name and sha256."""
        return info

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        """Requests served, rejected, cancelled and failed, the sizes of the batches, the queue and the limits."""
        queue = {"queue": batcher.queue_depth(), "queue_work": batcher.pending_work}
        return {**batcher.stats.to_json(), **queue, "limits": limits}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> str:
        return page

    return app


ERRORS = {
    413: "the body is larger than --max-body-bytes",
    422: "invalid request, or over a limit (--max-texts, --max-chars, --max-request-work: units of work for the source "
    "and output tokens and, with attention, the weights computed; --max-attention-weights: weights returned)",
    500: "the translation failed (the server's log has the details)",
    503: "queue full or shutting down; see Retry-After",
    504: "the translation took longer than --request-timeout",
}


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a one-line error (say, a port already in use)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise QkvError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart without waiting for TIME_WAIT
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        hint = "; is another server running there? choose another --port" if error.errno == errno.EADDRINUSE else ""
        raise QkvError(f"cannot listen on {host}:{port}: {error.strerror}{hint}") from None
    return sock


def default_searches(device: str | torch.device) -> int:
    """Batches ``qkv serve`` searches at once: on the CPU, one per thread up to two (qkv's search then runs
    each on its share of the threads; CTranslate2 splits each over all of its own, ``CTranslate2Translator``);
    one on a GPU. Measured on 2 cores: benchmarks/results/serve-throughput."""
    if torch.device(device).type != "cpu":
        return 1
    return max(1, min(2, torch.get_num_threads()))


def serve(
    checkpoint_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    graceful_timeout: float = 30.0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    loop_guard: int = 0,
    engine: str = "qkv",
    searches: int | None = None,
    batching: str = "batches",
    **limits: Any,
) -> None:
    """Run the app with uvicorn until SIGINT/SIGTERM. Requests in flight get up to graceful_timeout
    seconds to finish; then they are answered no more and their work stops. ``searches``: batches searched
    at once (None: ``default_searches``); on the CPU each qkv search then gets 1/searches of the threads."""
    import uvicorn

    from qkv.model.cpu import tune_allocator

    searches = default_searches(device) if searches is None else searches
    if searches < 1:
        raise QkvError(f"--searches must be at least 1, got {searches}")
    if engine == "qkv" and torch.device(device).type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // searches))
    app = create_app(checkpoint_dir, device=device, dtype=dtype, loop_guard=loop_guard, engine=engine, searches=searches,
                     batching=batching, **limits)
    if torch.device(device).type == "cpu":
        tune_allocator()  # the server process's choice: decoding frees and allocates every step (qkv.model.cpu)
    sock = listen(host, port)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_timeout)
    logging.getLogger("uvicorn.error").info("qkv serve on http://%s:%d (Press CTRL+C to quit)", host, port)
    uvicorn.Server(config).run(sockets=[sock])
