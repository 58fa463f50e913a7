"""Serving translations over HTTP: a JSON API with dynamic batching, OpenAPI docs and an attention page.

One model instance answers every request. Requests wait in a bounded asyncio queue; a single worker
takes what has arrived (up to ``max_batch_sentences`` sentences and ``max_batch_tokens`` source tokens,
waiting at most ``max_wait_ms`` for more), groups it by decoding settings and translates each group
as one batch in a worker thread (PyTorch releases the GIL, so the event loop keeps accepting requests
meanwhile). A full queue answers 503 with Retry-After instead of letting latency grow without bound.

Endpoints: ``POST /v1/translate``, ``GET /v1/model``, ``GET /v1/stats``, ``GET /health``, the page at
``/`` and FastAPI's ``/docs`` and ``/openapi.json``. Note: no ``from __future__ import annotations``
here, because FastAPI reads the request model from the endpoint's annotations at run time.
"""

import asyncio
import json
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool, StringConstraints, field_validator

from qkv import checkpoint
from qkv.decode import DecodeConfig
from qkv.model import Transformer
from qkv.tokenizer import Tokenizer
from qkv.translate import Translator
from qkv.visualize import capture_attention

log = logging.getLogger("qkv.server")

MAX_BEAM = 16
RETRY_AFTER_S = 1  # what a 503 tells clients to wait; one batch takes well under a second

# The decoding settings that must be equal for requests to share a batch: beam size, max length, attention.
Settings = tuple[int, int | None, bool]


class Busy(Exception):
    """The queue is full, or the server is shutting down: answer 503 with Retry-After."""


@dataclass
class Job:
    """One request: its texts, their token ids, its decoding settings and the future its handler awaits."""

    texts: list[str]
    src_ids: list[list[int]]
    settings: Settings
    future: asyncio.Future
    n_tokens: int = 0  # source tokens, each sentence's EOS included

    def __post_init__(self) -> None:
        self.n_tokens = sum(len(ids) + 1 for ids in self.src_ids)


@dataclass
class Stats:
    requests: int = 0  # accepted into the queue
    rejected: int = 0  # answered 503
    cancelled: int = 0  # the client went away before its batch ran
    failed: int = 0
    batches: int = 0
    sentences: int = 0
    batch_requests: int = 0
    batch_sizes: Counter = field(default_factory=Counter)  # sentences per batch -> how many batches

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "rejected": self.rejected,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "batches": self.batches,
            "sentences": self.sentences,
            "mean_batch_size": self.sentences / self.batches if self.batches else 0.0,
            "mean_batch_requests": self.batch_requests / self.batches if self.batches else 0.0,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
        }


class Batcher:
    """The queue, the worker that forms batches from it, and the thread that runs the model."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        max_batch_sentences: int,
        max_batch_tokens: int,
        max_wait_ms: float,
        max_queue: int,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_sentences, self.max_batch_tokens = max_batch_sentences, max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.max_queue = max_queue
        self.stats = Stats()
        self.closing = False
        self._queue: asyncio.Queue[Job | None] | None = None
        self._held: Job | None = None  # taken from the queue but did not fit the last batch
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="qkv-translate")

    def start(self) -> None:
        # The queue is made here, inside the server's event loop.
        self._queue = asyncio.Queue(self.max_queue)
        self._task = asyncio.create_task(self._run(), name="qkv-batcher")

    async def close(self) -> None:
        """Stop accepting work, translate everything already queued, then stop the worker."""
        self.closing = True
        if self._task is not None:
            await self._queue.put(None)  # FIFO: queued requests come first
            await self._task
        self._executor.shutdown(wait=True)

    def queue_depth(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    def submit(self, texts: list[str], src_ids: list[list[int]], settings: Settings) -> asyncio.Future:
        if self.closing or self._queue is None:
            self.stats.rejected += 1
            raise Busy("the server is shutting down")
        job = Job(texts, src_ids, settings, asyncio.get_running_loop().create_future())
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self.stats.rejected += 1
            raise Busy(f"the translation queue is full ({self.max_queue} requests waiting)") from None
        self.stats.requests += 1
        return job.future

    async def _next(self, timeout: float | None) -> Job | None:
        if self._held is not None:
            job, self._held = self._held, None
            return job
        if timeout is None:
            return await self._queue.get()
        if timeout <= 0:
            return self._queue.get_nowait()  # raises QueueEmpty
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def _collect(self) -> tuple[list[Job], bool]:
        """The next batch: whatever arrives within max_wait of the first request, within the budgets.
        A request is never split; one larger than the budgets makes a batch on its own."""
        first = await self._next(None)
        if first is None:
            return [], True
        batch, sentences, tokens = [first], len(first.texts), first.n_tokens
        deadline = time.monotonic() + self.max_wait
        while sentences < self.max_batch_sentences and tokens < self.max_batch_tokens:
            try:
                job = await self._next(max(deadline - time.monotonic(), 0.0))
            except (asyncio.TimeoutError, asyncio.QueueEmpty):  # the two differ on Python 3.10
                break
            if job is None:
                return batch, True
            if sentences + len(job.texts) > self.max_batch_sentences or tokens + job.n_tokens > self.max_batch_tokens:
                self._held = job
                break
            batch.append(job)
            sentences, tokens = sentences + len(job.texts), tokens + job.n_tokens
        return batch, False

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping or self._held is not None:
            if stopping:  # the sentinel came while a request was held back: finish that one too
                batch = [self._held]
                self._held = None
            else:
                batch, stopping = await self._collect()
            groups: dict[Settings, list[Job]] = {}
            for job in batch:
                if job.future.done():  # cancelled: its client went away
                    self.stats.cancelled += 1
                else:
                    groups.setdefault(job.settings, []).append(job)
            for settings, jobs in groups.items():
                try:
                    results = await loop.run_in_executor(self._executor, self.translate_group, settings, jobs)
                except Exception as error:  # one failed batch must not stop the server
                    log.exception("translation failed for a batch of %d requests", len(jobs))
                    self.stats.failed += len(jobs)
                    for job in jobs:
                        if not job.future.done():
                            job.future.set_exception(RuntimeError(f"translation failed: {error}"))
                    continue
                n = sum(len(job.texts) for job in jobs)
                self.stats.batches += 1
                self.stats.sentences += n
                self.stats.batch_requests += len(jobs)
                self.stats.batch_sizes[n] += 1
                for job, result in zip(jobs, results):
                    if not job.future.done():
                        job.future.set_result(result)

    def translate_group(self, settings: Settings, jobs: list[Job]) -> list[dict[str, Any]]:
        """Runs in the worker thread: one batch of requests with equal settings -> one result each."""
        beam_size, max_length, attention = settings
        config = DecodeConfig(beam_size=beam_size)
        if max_length is not None:
            config = DecodeConfig(beam_size=beam_size, max_len_a=0.0, max_len_b=max_length)
        if attention:  # captured one sentence at a time: the weights of exactly the returned output
            out = []
            for job in jobs:
                captures = [self._capture(text, ids, config) for text, ids in zip(job.texts, job.src_ids)]
                out.append({"translations": [c["translation"] for c in captures], "attention": captures})
            return out
        translator = Translator(
            self.model, self.tokenizer, config,
            max_tokens=self.max_batch_tokens, max_sentences=self.max_batch_sentences,
        )
        all_ids = [ids for job in jobs for ids in job.src_ids]
        hyps = translator.translate_ids(all_ids)
        texts = [self.tokenizer.decode(h[0].tokens) for h in hyps]
        out, start = [], 0
        for job in jobs:
            out.append({"translations": texts[start : start + len(job.texts)]})
            start += len(job.texts)
        return out

    def _capture(self, text: str, ids: list[int], config: DecodeConfig) -> dict[str, Any]:
        if not ids:  # as Translator: an empty input translates to ''; one key gets all the weight
            c = self.model.config
            ones = [[[[1.0]] for _ in range(c.n_heads)] for _ in range(c.n_decoder_layers)]
            return {"source": text, "translation": "", "src_tokens": ["</s>"], "tgt_tokens": ["</s>"], "cross": ones}
        capture = capture_attention(self.model, self.tokenizer, text, config)
        return {
            "source": text,
            "translation": capture.translation,
            "src_tokens": capture.src_tokens,
            "tgt_tokens": capture.tgt_tokens,
            "cross": capture.cross.double().round(decimals=4).tolist(),  # (L, H, T, S)
        }


class AttentionOut(BaseModel):
    source: str
    translation: str
    src_tokens: list[str] = Field(description="S source subword pieces, EOS last")
    tgt_tokens: list[str] = Field(description="T target subword pieces, EOS last")
    cross: list[list[list[list[float]]]] = Field(
        description="cross-attention weights (layers, heads, T, S): row t is where target token t looked"
    )


class TranslateResponse(BaseModel):
    translations: list[str] = Field(description="one translation per input text, in order")
    attention: list[AttentionOut] | None = Field(None, description="only when the request asked for attention")


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


class ErrorOut(BaseModel):
    detail: str


def _whole_number(value: Any) -> Any:
    # JSON Schema counts 5.0 as an integer, so accept it (pydantic turns it into 5 and rejects 5.5),
    # but not true or "5", which pydantic's lax mode would take as numbers.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a whole number")
    return value


def _whole_number_between(low: int, high: int) -> Any:
    # The bounds come first so that they appear in the JSON schema as minimum and maximum.
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_whole_number)]


def _request_model(*, max_texts: int, max_chars: int, max_output: int) -> type[BaseModel]:
    """The request body, with this server's limits in its schema (so /openapi.json documents them)."""
    Text = Annotated[str, Strict(), StringConstraints(max_length=max_chars)]
    BeamSize = _whole_number_between(1, MAX_BEAM)
    OutputLength = _whole_number_between(1, max_output)

    class TranslateRequest(BaseModel):
        model_config = ConfigDict(
            extra="forbid",  # a misspelt field is an error, not silently ignored
            json_schema_extra={"examples": [{"texts": ["A man rides a bike."], "beam_size": 5}]},
        )

        texts: list[Text] = Field(
            min_length=1, max_length=max_texts,
            description=f"sentences to translate: 1 to {max_texts}, each at most {max_chars} characters",
        )
        beam_size: BeamSize = Field(5, description="beam size (1 = greedy search)")
        max_length: OutputLength | None = Field(
            None, description=f"maximum output tokens, at most {max_output} (default: 1.5 x source tokens + 10)"
        )
        attention: StrictBool = Field(False, description="also return each translation's cross-attention and tokens")

        @field_validator("texts")
        @classmethod
        def _encodable(cls, texts: list[str]) -> list[str]:
            for i, text in enumerate(texts):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"texts[{i}] is not valid Unicode (it contains a lone surrogate)") from None
            return texts

    return TranslateRequest


def model_info(loaded: checkpoint.Checkpoint) -> dict[str, Any]:
    """What ``GET /v1/model`` answers: languages, sizes, vocabulary and the checkpoint's identity."""
    data = loaded.config.get("data") or {}
    config = loaded.model.config
    return {
        "src_lang": data.get("src_lang"),
        "tgt_lang": data.get("tgt_lang"),
        "checkpoint": str(loaded.path.resolve()),
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


def page_html() -> str:
    return resources.files("qkv").joinpath("server.html").read_text(encoding="utf-8")


def create_app(
    checkpoint_dir: str | Path,
    *,
    max_batch_sentences: int = 32,
    max_batch_tokens: int = 4096,
    max_wait_ms: float = 10,
    max_queue: int = 256,
    max_texts: int = 64,
    max_chars: int = 1000,
) -> FastAPI:
    """Load the checkpoint (errors surface here, before any port is bound) and build the app."""
    limits = dict(
        max_batch_sentences=max_batch_sentences, max_batch_tokens=max_batch_tokens, max_queue=max_queue,
        max_texts=max_texts, max_chars=max_chars,
    )
    for name, value in limits.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if max_wait_ms < 0:
        raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
    loaded = checkpoint.load(checkpoint_dir)
    info = model_info(loaded)
    tokenizer, max_src = loaded.tokenizer, loaded.model.config.max_len - 1
    batcher = Batcher(
        loaded.model, tokenizer, max_batch_sentences=max_batch_sentences, max_batch_tokens=max_batch_tokens,
        max_wait_ms=max_wait_ms, max_queue=max_queue,
    )
    TranslateRequest = _request_model(max_texts=max_texts, max_chars=max_chars, max_output=max_src)
    page = page_html()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        # uvicorn calls this after in-flight requests have been answered (SIGTERM's graceful shutdown).
        await batcher.close()

    app = FastAPI(
        title="qkv translation server",
        version="1",
        description=f"Transformer translation ({info['src_lang']} -> {info['tgt_lang']}) with dynamic batching.",
        lifespan=lifespan,
        exception_handlers={RequestValidationError: _invalid_request},
    )
    app.state.batcher = batcher

    @app.post(
        "/v1/translate",
        response_model=TranslateResponse,
        response_model_exclude_none=True,
        responses={503: {"model": ErrorOut, "description": "queue full or shutting down; see Retry-After"}},
    )
    async def translate(body: TranslateRequest):  # type: ignore[valid-type]
        """Translate texts, in order; with `attention`, also each output's cross-attention and tokens."""
        src_ids = [tokenizer.encode(text)[:max_src] for text in body.texts]
        try:
            future = batcher.submit(body.texts, src_ids, (body.beam_size, body.max_length, body.attention))
        except Busy as busy:
            return JSONResponse({"detail": f"server busy: {busy}; retry later"}, 503, {"Retry-After": str(RETRY_AFTER_S)})
        try:
            return await future
        except RuntimeError as error:
            return JSONResponse({"detail": str(error)}, 500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "queue": batcher.queue_depth()}

    @app.get("/v1/model")
    async def model() -> dict[str, Any]:
        """Languages, sizes, vocabulary size, parameter count and the checkpoint's path and sha256."""
        return info

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        """Requests served and rejected, and the sizes of the batches the worker formed."""
        return {**batcher.stats.to_json(), "queue": batcher.queue_depth(), "limits": {**limits, "max_wait_ms": max_wait_ms}}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> str:
        return page

    return app


def serve(
    checkpoint_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    graceful_timeout: float = 30.0,
    **limits: Any,
) -> None:
    """Run the app with uvicorn until SIGINT/SIGTERM; in-flight requests finish first (up to graceful_timeout)."""
    import uvicorn

    app = create_app(checkpoint_dir, **limits)
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout
    )
