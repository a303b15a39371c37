"""An OpenAI-compatible HTTP server on the serving engine (serve.py), for chat front-ends, the `openai` client and
evaluation harnesses (lm-evaluation-harness's local-completions and local-chat-completions).

    python server.py [--checkpoint DIR] [--host 127.0.0.1] [--port 8000] [--max-batch 16] [--max-waiting N]
    GET /health, /v1/models; POST /v1/completions, /v1/chat/completions (stream: server-sent events)

The engine loop runs in one background thread after its warm-up (until then /health and requests get 503). Handlers
never touch tensors: they check a request (strict pydantic models; errors in OpenAI's body) and submit() its prompts;
the engine's thread hands each read-back to the event loop. Beyond the rows and --max-waiting: 429. A client gone
has its requests aborted. Streamed text stops at Request.final (a stop string is never half sent). `n` > 1
is n requests (with a `seed`, choice i draws with seed + i: the same request, the same choices, whatever the batch).
"""
import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import socket
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2.exceptions import TemplateError
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

from common import DTYPES, UsageError, default_device
from quantize import prepare_default
from serve import LLM, TOP_LOGPROBS, SamplingParams


class APIError(Exception):
    """An HTTP error with OpenAI's body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param=None, code=None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def response(self, request=None, error=None) -> JSONResponse:  # (also an exception handler's signature)
        return JSONResponse(self.body, self.status)


class Strict(BaseModel):  # strict types ("0.5" is not a number, true not an integer); a null field: its default
    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def nulls_to_defaults(cls, data):  # (a lone surrogate in a field read: UnicodeEncodeError, a 400; Message: its own)
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) and json.dumps(
            [data.get(k) for k in cls.model_fields if k != "messages"], ensure_ascii=False).encode() else data


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]  # (developer: OpenAI's newer system)
    content: str | list[dict[str, str]] = ""  # a text, or parts {"type": "text", "text": ...} (null: a tool call's)


class Body(Strict):  # both endpoints' fields, OpenAI's defaults (top_k: an extension, as vLLM's and llama.cpp's)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, ge=0, le=1)  # (0: the likeliest token alone, as OpenAI)
    top_k: int | None = Field(None, ge=1)
    stop: str | Annotated[list[str], Field(max_length=4)] = []
    n: int = Field(1, ge=1)
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, bool] = {}  # {"include_usage": true}: a last chunk with the usage


class Chat(Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)


class Completion(Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)


class Server:
    """The app over one engine: the engine's thread (warm-up, then LLM.loop) and the handlers."""

    def __init__(self, llm: LLM, name: str, max_waiting: int):
        self.llm, self.tok, self.name, self.max_waiting = llm, llm.tokenizer, name, max_waiting
        self.rows, self.created = llm.runner.buckets[-1], int(time.time())
        self.live = 0  # requests submitted and not finished (changed on the event loop's thread only)
        self.ready, self.stop = threading.Event(), threading.Event()
        self.engine = threading.Thread(target=self.run_engine, name="engine", daemon=True)
        app = self.app = FastAPI(lifespan=self.lifespan)
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.exception_handler(APIError)(lambda request, e: e.response())
        app.exception_handler(RequestValidationError)(self.invalid)
        app.exception_handler(HTTPException)(lambda request, e: APIError(e.status_code, str(e.detail)).response())
        app.exception_handler(Exception)(APIError(500, "internal error (logged by the server)", kind="server_error")
                                         .response)

    def run_engine(self) -> None:
        start, r = time.perf_counter(), self.llm.runner
        self.llm.warm_up(lambda what, s: log(f"engine: {what} warm ({s:.1f} s)"))
        log(f"engine: {r.how}, buckets {r.buckets}, {r.steps} decode steps a round, {r.length} positions a row; "
            f"ready in {time.perf_counter() - start:.1f} s")
        self.ready.set()
        self.llm.loop(self.stop)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.engine.start()
        yield
        self.stop.set()  # (live requests end as aborted)
        self.engine.join(timeout=30)

    @staticmethod
    def invalid(request, e: RequestValidationError) -> JSONResponse:
        """Not JSON, or not the endpoint's fields: 400 naming the first wrong field (a union's errors joined)."""
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return APIError(400, f"the body is not JSON: {first.get('ctx', {}).get('error')}").response()
        param = str(first["loc"][1]) if len(first["loc"]) > 1 else None
        why = " or ".join(dict.fromkeys(x["msg"] for x in e.errors() if x["loc"][:2] == first["loc"][:2]))
        return APIError(400, f"{param or 'the body'}: {why}", param).response()

    def health(self) -> dict:  # (and before a request is taken)
        if not self.engine.is_alive() or not self.ready.is_set():
            raise APIError(503, "warming up" if self.engine.is_alive() else "the engine stopped", kind="unavailable")
        return {"status": "ok"}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "graphdecode"}]}

    def submit(self, body: Body, prompts: list[list[int]], max_tokens: int | None, **logprobs) -> tuple:
        """Each prompt n times into the engine (all checked first; no max_tokens: what its row has room for) -> the
        requests, and a queue of their read-backs (index, new tokens, finished), filled whether read or not."""
        self.health()
        if body.model not in (None, self.name):
            raise APIError(404, f"the model {body.model!r} does not exist (this server has {self.name!r})", "model",
                           "model_not_found")
        if body.n > self.rows or len(prompts) * body.n > self.rows + self.max_waiting:  # (never taken: not a 429)
            raise APIError(400, f"{len(prompts)} prompt(s) x n ({body.n}) is more than the server takes (n up to its "
                           f"{self.rows} rows, {self.rows + self.max_waiting} requests at once)", "n")
        if not prompts or not all(prompts):
            raise APIError(400, "the prompt is empty", "prompt")
        if self.live + len(prompts) * body.n > self.rows + self.max_waiting:
            raise APIError(429, f"{self.max_waiting} requests are waiting already; retry later", None,
                           "rate_limit_exceeded", "rate_limit_error")
        stop, room = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop), self.llm.runner.length
        params = [SamplingParams(body.temperature, body.top_k, body.top_p, stop=stop, **logprobs,
                                 max_new_tokens=max_tokens or max(1, room - len(ids))) for ids in prompts]
        try:
            for ids, p in zip(prompts, params):
                self.llm.make_request(ids, p)
        except UsageError as e:
            raise APIError(400, str(e).replace("max_new_tokens", "max_tokens")) from None
        inbox, loop = asyncio.Queue(), asyncio.get_running_loop()

        def arrive(i: int, message: tuple[list[int], bool]) -> None:  # (on the event loop's thread)
            self.live -= message[1]
            inbox.put_nowait((i, len(message[0]), message[1]))

        def outbox(i: int) -> SimpleNamespace:  # its put((new ids, finished)), on the engine's thread: arrive(i, ...)
            return SimpleNamespace(put=functools.partial(loop.call_soon_threadsafe, arrive, i))
        each = [(ids, p if body.seed is None else replace(p, seed=body.seed + i)) for ids, p in zip(prompts, params)
                for i in range(body.n)]
        self.live += len(each)
        return [self.llm.submit(ids, p, outbox(i)) for i, (ids, p) in enumerate(each)], inbox

    async def events(self, reqs: list, inbox: asyncio.Queue):
        """(index, request, new text, out[lo:hi] the new tokens, first, finish reason or None) a read-back, as they
        come; the requests are aborted if the consumer stops early (a client gone)."""
        sent, got, left = [0] * len(reqs), [0] * len(reqs), len(reqs)
        try:
            while left and (message := await inbox.get()):  # (None: the client is gone)
                i, n, finished = message
                r = reqs[i]
                final = r.final  # (read before the text: text[:final] no longer changes)
                text = r.text[sent[i]:None if finished else final]
                yield i, r, text, got[i], got[i] + n, sent[i] == got[i] == 0, r.finish_reason if finished else None
                sent[i], got[i], left = sent[i] + len(text), got[i] + n, left - finished
        finally:
            for r in reqs if left else []:
                self.llm.abort(r)

    async def respond(self, body: Body, kind: str, prompts: list, max_tokens: int | None, choice, client, **logprobs):
        """A JSON object, or with `stream` server-sent events: a chunk a read-back, the usage if asked, [DONE].
        choice(index, request, text, lo, hi, first, finish reason) -> a choice (its text, of tokens out[lo:hi])."""
        reqs, inbox = self.submit(body, prompts, max_tokens, **logprobs)
        head = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
                "created": int(time.time()), "model": self.name}

        def usage() -> dict:  # (a prompt counted once, however many choices it has)
            prompt, out = sum(map(len, prompts)), sum(len(r.out) for r in reqs)
            return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}
        if not body.stream:  # (every read-back, unless the client goes first: receive() returns, a None comes)
            gone = asyncio.ensure_future(client.receive())
            gone.add_done_callback(lambda _: inbox.put_nowait(None))
            try:
                async for _ in self.events(reqs, inbox):
                    pass
            finally:
                gone.cancel()
            if any(r.finish_reason not in ("stop", "length") for r in reqs):
                raise APIError(503, "the engine stopped", kind="unavailable")
            choices = [choice(i, r, r.text, 0, len(r.out), True, r.finish_reason) for i, r in enumerate(reqs)]
            return {**head, "object": kind, "choices": choices, "usage": usage()}
        head["object"] = kind + ".chunk" if kind == "chat.completion" else kind
        extra = {"usage": None} if body.stream_options.get("include_usage") else {}

        async def stream():
            async for event in self.events(reqs, inbox):
                yield f"data: {json.dumps({**head, 'choices': [choice(*event)], **extra})}\n\n"
            if extra:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    async def chat(self, body: Chat, client: Request):
        messages = [{"role": m.role.replace("developer", "system"), "content": m.content if isinstance(m.content, str)
                     else "\n".join(part.get("text", "") for part in m.content)} for m in body.messages]
        try:
            ids = self.tok.encode_chat(messages)
        except TemplateError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None

        def choice(i, r, text, lo, hi, first, finish):
            role = {"role": "assistant"} if first or not body.stream else {}
            return {"index": i, "delta" if body.stream else "message": {**role, "content": text}, "logprobs": None,
                    "finish_reason": finish}
        return await self.respond(body, "chat.completion", [ids], body.max_completion_tokens or body.max_tokens, choice,
                                  client)

    async def completions(self, body: Completion, client: Request):
        p = body.prompt  # a text, texts, token ids, or lists of token ids
        if isinstance(p, str) or p and isinstance(p[0], str):
            prompts = [self.tok.encode(text) for text in ([p] if isinstance(p, str) else p)]
        else:
            prompts = [p] if p and isinstance(p[0], int) else p
        echo = [self.tok.decode(ids) if body.echo else "" for ids in prompts]
        sent = [0] * len(prompts) * body.n  # each choice's tokens' text so far (text_offset counts from there)

        def choice(i, r, text, lo, hi, first, finish):
            text = (echo[i // body.n] if first else "") + text
            logprobs = self.logprobs(r, lo, hi, first and body.echo, body.logprobs, sent[i])
            sent[i] += sum(map(len, logprobs["tokens"])) if logprobs else 0
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        lp = body.logprobs is not None
        return await self.respond(body, "text_completion", prompts, body.max_tokens, choice, client, logprobs=lp,
                                  prompt_logprobs=lp and body.echo, top_logprobs=body.logprobs or 0)

    def logprobs(self, r, lo: int, hi: int, echo: bool, n: int | None, offset: int) -> dict | None:
        """The legacy completions' logprobs (n None: none) of r's tokens out[lo:hi] (with echo, its prompt's first):
        each token's text, log-probability (the first prompt token's null) and top n alternatives (with the chosen
        token, as OpenAI gives them), and each token's offset in the choice's text (the first token's: offset)."""
        if n is None:
            return None
        ids = (r.prompt if echo else []) + r.out[lo:hi]
        lps = (r.prompt_logprobs if echo else []) + r.logprobs[lo:hi]
        alternatives = (r.prompt_top_logprobs if echo else []) + r.top_logprobs[lo:hi] if n else itertools.repeat(())
        texts = [self.tok.decode([t]) for t in ids]
        top = [None if lp is None else {**{self.tok.decode([a]): v for a, v in alt}, text: lp}
               for text, lp, alt in zip(texts, lps, alternatives)]
        offsets = list(itertools.accumulate(map(len, texts), initial=offset))[:-1]
        return {"tokens": texts, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


log = functools.partial(print, file=sys.stderr, flush=True)


def listen(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except (OSError, OverflowError) as e:
        raise UsageError(f"cannot listen on {host}:{port} ({e})") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="An OpenAI-compatible HTTP server on the serving engine (serve.py).")
    p.add_argument("--checkpoint", type=Path, help="checkpoint directory (default: the default model)")
    p.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s; 0: any free port)")
    p.add_argument("--max-batch", type=int, default=16, help="KV-cache rows: requests decoded at once (default: 16)")
    p.add_argument("--max-waiting", type=int, help="requests waiting for a row, then 429 (default: 4x --max-batch)")
    p.add_argument("--max-length", type=int, default=1024, help="positions a row holds, a prompt and its output "
                   "(default: %(default)s or the model's context if less)")
    p.add_argument("--compile", action="store_true", help="the CPU: build each bucket's step ahead of time, once "
                   "(~1 min a bucket, cached); without it a step built before is used, else eager decode")
    p.add_argument("--device", choices=["cuda", "cpu"], help="(default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="(default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--no-kernels", action="store_true", help="run the plain model.py, without the kernels package")
    return p


def load(args) -> Server:
    """The flags checked and the model loaded (the engine warms up in its thread once the server starts)."""
    max_waiting = 4 * args.max_batch if args.max_waiting is None else args.max_waiting
    if max_waiting < 0:
        raise UsageError(f"--max-waiting must be >= 0 (got {max_waiting})")
    device = default_device(args.device)
    checkpoint = args.checkpoint or prepare_default(device)  # (the CPU: its int4 form, as generate.py)
    llm = LLM(checkpoint, device, args.dtype, args.max_batch, args.max_length, kernels=not args.no_kernels,
              compile=args.compile or None)
    return Server(llm, Path(checkpoint).name, max_waiting)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sock = listen(args.host, args.port)  # (first: a port in use fails before the model loads)
        server = load(args)
    except (UsageError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log(f"{server.name} on http://{args.host}:{sock.getsockname()[1]}/v1 (warming up: /health answers 503 until ready)")
    uvicorn.Server(uvicorn.Config(server.app, log_level="warning")).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
