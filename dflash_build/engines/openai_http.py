"""One server over HTTP, for the openai backend: its errors, request bodies, identity check, and the
calls themselves (each attempt within a deadline, faults retried with backoff, answers parsed into
Results or refused as Malformed). :class:`ServerClient` holds what one job knows of its servers;
:class:`~dflash_build.engines.openai_backend.OpenAIEngine` adds the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from dflash_build import loops
from dflash_build.engines import sglang_wire
from dflash_build.engines.base import Acceptance, Request, Result
from dflash_build.engines.base import EngineStalled as EngineMadeNoProgress
from dflash_build.engines.sglang_wire import parse_output, sampling_params

if TYPE_CHECKING:
    import httpx

    from dflash_build.spec import LoopRule

log = logging.getLogger(__name__)
T = TypeVar("T")

APIS = ("completions", "generate")
PROMPT_MODES = ("auto", "ids", "text")
_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
# How servers refuse a token-id prompt (llama.cpp: a 500 validation error); busy answers are not refusals.
_REFUSAL_STATUS = frozenset({400, 415, 422, 500})
_SHOWN = 300  # characters of a server's answer quoted in errors


class ServerDown(RuntimeError):
    """A server did not answer usefully through every retry: the job fails, its journal stays."""

    timed_out = False  # its last attempt got no answer at all within the deadline (a stopped process)


class EngineStalled(ServerDown, EngineMadeNoProgress):
    """A server held requests without answering for ``stall_timeout`` and failed its health check."""


class HTTPFailure(Exception):
    """The server answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:_SHOWN]}")
        self.status = status


class ModelMismatch(RuntimeError):
    """A server serves another model than model.path: its answers would be stored under the wrong key."""


class RequestRefused(HTTPFailure):
    """A 4xx the server will not change its mind about (bad prompt, prompt too long, ...)."""


class ServerError(ServerDown, HTTPFailure):
    """A 5xx or 429 that outlasted every retry."""

    def __init__(self, status: int, message: str) -> None:
        RuntimeError.__init__(self, message)
        self.status = status


class Malformed(Exception):
    """A 200 answer that is not a usable completion: retried like a 5xx, never stored."""


class Aborted(Exception):
    """A well-formed answer whose finish_reason says the server gave up on the request: retried."""

    def __init__(self, result: Result) -> None:
        super().__init__(result.error)
        self.result = result


# "No top-k" is -1 for SGLang and vLLM; llama.cpp refuses -1 and means the same by 0.
TOP_K_OFF = (-1, 0)


def completions_body(
    request: Request, model: str, prompt: list[int] | str, stop_token_ids: list[int], top_k_off: int = -1
) -> dict[str, Any]:
    p = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "min_p": p.min_p,
        # sent even when disabled: leaving it out would apply the server's own default
        "top_k": p.top_k if p.top_k > 0 else top_k_off,
        "seed": request.seed,
        # Servers' own defaults are not ours (llama.cpp's repeat_penalty is 1.1): every knob is sent.
        "repetition_penalty": 1.0,
        "repeat_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": list(stop_token_ids),
        "skip_special_tokens": False,
        "return_token_ids": True,  # vLLM: token ids of the answer in the response
    }
    return body


def served_identities(models: Any, model_info: Any) -> list[str]:
    """What a server says it serves: /v1/models ids and roots (vLLM), SGLang's /get_model_info path."""
    names: list[str] = []
    for entry in (models or {}).get("data") or []:
        names += [str(entry[k]) for k in ("id", "root") if isinstance(entry, dict) and entry.get(k)]
    if isinstance(model_info, dict) and model_info.get("model_path"):
        names.append(str(model_info["model_path"]))
    return names


def _model_ids(models: Any) -> list[str]:
    """The ids a /v1/models answer lists, in its order."""
    return [e["id"] for e in (models or {}).get("data") or [] if isinstance(e, dict) and "id" in e]


def matches_model(served: list[str], model_path: str, expect: str | None) -> bool:
    """A served name is model.path, ends with its folder or file name, or is the name the config expects."""
    wanted = {model_path.rstrip("/"), os.path.basename(model_path.rstrip("/"))}
    if expect:
        wanted.add(expect)
    return any(name.rstrip("/") in wanted or os.path.basename(name.rstrip("/")) in wanted for name in served)


def completion_acceptance(out: Any) -> Acceptance | None:
    """A speculative request's counts from vLLM's answer (``metrics.speculative_decoding``, which a server
    started with ``per_request_spec_decode_metrics`` adds: ``num_spec_steps``, ``num_draft_tokens``,
    ``num_accepted_draft_tokens``, ``acceptance_histogram``); None without it."""
    spec = (out.get("metrics") or {}).get("speculative_decoding") if isinstance(out, dict) else None
    if not isinstance(spec, dict):
        return None  # a request the server drafted nothing for is counted: 0 steps (ngram without a match)
    histogram = tuple(int(n) for n in spec.get("acceptance_histogram") or ())
    drafted, accepted = int(spec.get("num_draft_tokens") or 0), int(spec.get("num_accepted_draft_tokens") or 0)
    # `detailed` only (vllm PR #48915): each verify step's counts, in order
    per_step = [tuple(int(n) for n in spec.get(k) or ()) for k in ("per_step_accepted", "per_step_drafted")]
    return Acceptance(int(spec.get("num_spec_steps") or 0), drafted, accepted, histogram, *per_step)


def generate_body(request: Request, stop_token_ids: list[int], loops_in_request: bool = False) -> dict[str, Any]:
    """SGLang's native /generate takes the in-process engine's sampling params as they are; the loop rule
    goes only to a server that stops rows on it itself (``loops_in_request``: ours), SGLang has no such field."""
    body: dict[str, Any] = {
        "input_ids": request.prompt_ids,
        "sampling_params": sampling_params(request, stop_token_ids),
    }
    if request.stop_loops is not None and loops_in_request:
        body["stop_loops"] = request.stop_loops.as_dict()
    return body


class CompletionStream:
    """A /v1/completions answer streamed with its token ids (vLLM's chunks: ``choices[].token_ids``, and with
    ``include_usage`` a last chunk of the request's usage and metrics, its speculative counts), read against
    the loop rule; :class:`~dflash_build.engines.sglang_wire.GenerateStream` is /generate's."""

    def __init__(self, rule: LoopRule) -> None:
        self.ids: list[int] = []
        self.text: list[str] = []
        self.finish: Any = None
        self.usage: Any = None
        self.metrics: Any = None
        self.watch = loops.Watch(rule)

    @staticmethod
    def streamed(body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "stream": True, "stream_options": {"include_usage": True}}

    def read(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """Take one chunk; once the rule has fired, the answer cut where it first fired (finish reason
        ``loop``), else None."""
        self.usage, self.metrics = chunk.get("usage") or self.usage, chunk.get("metrics") or self.metrics
        for choice in chunk.get("choices") or []:
            if not isinstance(choice.get("token_ids"), list):
                raise Malformed(f"a streamed chunk without token_ids: {json.dumps(chunk)[:_SHOWN]}")
            self.ids += choice["token_ids"]
            self.text.append(choice.get("text") or "")
            self.finish = choice.get("finish_reason") or self.finish
        end = self.watch.end(self.ids, last=self.finish is not None)
        return None if end is None else {"choices": [{"token_ids": self.ids[:end], "finish_reason": "loop"}]}

    def whole(self) -> dict[str, Any]:
        choices = [{"token_ids": self.ids, "text": "".join(self.text), "finish_reason": self.finish}]
        return {"choices": choices, "usage": self.usage, "metrics": self.metrics}


# How each streamed path is read: both answer as their whole JSON would, so the caller parses both alike.
_STREAMS: dict[str, Any] = {"/v1/completions": CompletionStream, "/generate": sglang_wire.GenerateStream}


class ServerClient:
    """The calls to one server: what a job's engine sends and how it reads the answers. Its owner sets
    ``opts`` (the backend's options), ``stop_token_ids``, ``tokenizer`` (for text prompts and answers),
    ``prompt_mode``, ``probe_seconds``, ``pool`` and ``_client`` (an ``httpx.AsyncClient``)."""

    opts: dict[str, Any]
    stop_token_ids: list[int]
    tokenizer: Any
    prompt_mode: str
    probe_seconds: float
    pool: Any
    _client: httpx.AsyncClient

    def __init__(self, loops_in_request: bool = False) -> None:
        # where a looping row stops: the rule in the request (ours), else the stream closed (registry.Serve)
        self.loops_in_request = loops_in_request
        self.top_k_off: dict[str, int] = {}  # per server, once it refused the first spelling
        self._model_ids: dict[str, list[str]] = {}  # /v1/models ids per server, read once
        self.identity: dict[str, list[str]] = {}

    async def _check_identity(self, url: str, model_path: str) -> list[str]:
        """What ``url`` serves; refuses a server whose model is not model.path's (the key names those files)."""
        answers = []
        for path in ("/v1/models", "/get_model_info"):
            try:
                answers.append(await self._call(url, path, None, retries=1, deadline=self.probe_seconds))
            except (RequestRefused, ServerDown):
                answers.append(None)
        self._model_ids[url] = _model_ids(answers[0])
        served = served_identities(*answers)
        if not matches_model(served, model_path, self.opts["expect_model"]):
            raise ModelMismatch(
                f"server {url} serves {served or 'a model it does not name'}, not model.path '{model_path}': "
                "its answers would be stored under that model's key. Point engine.options.urls at servers of "
                "model.path, or set engine.options.expect_model to the name the server reports for it."
            )
        return served

    async def _model_name(self, url: str) -> str:
        """The model name a request to ``url`` carries: engine.options.model, else the first id that server
        lists. A server that joined the pool after the job's first contact (a replacement, or one that
        stalled then) is asked once; vLLM refuses a name it does not serve (404), which would make every
        row an error row."""
        if self.opts["model"]:
            return str(self.opts["model"])
        if url not in self._model_ids:
            try:
                self._model_ids[url] = _model_ids(
                    await self._call(url, "/v1/models", None, retries=1, deadline=self.probe_seconds)
                )
            except (RequestRefused, ServerDown):  # a server without /v1/models takes any name
                self._model_ids[url] = []
        return next((ids[0] for ids in (self._model_ids[url], *self._model_ids.values()) if ids), "default")

    async def _attempt(self, url: str, path: str, body: dict[str, Any] | None, watch: LoopRule | None = None) -> Any:
        """One request: the JSON it answers, or the failure it is (``watch``: streamed, :meth:`_streamed`)."""
        if watch is not None and body is not None:
            return await self._streamed(url, path, body, watch)
        if body is None:
            response = await self._client.get(url + path)
        else:
            response = await self._client.post(url + path, json=body)
        text = response.text
        if response.status_code >= 400:
            if response.status_code not in _RETRY_STATUS:
                raise RequestRefused(response.status_code, text)
            if "validation error" in text:  # llama.cpp answers a bad request with a 500: no retry helps
                raise HTTPFailure(response.status_code, text)
            raise _Retry(f"HTTP {response.status_code}: {text[:_SHOWN]}", response.status_code)
        try:
            return json.loads(text)
        except ValueError:
            raise Malformed(f"HTTP {response.status_code} with a body that is not JSON: {text[:_SHOWN]!r}") from None

    async def _streamed(self, url: str, path: str, body: dict[str, Any], watch: LoopRule) -> Any:
        """An answer streamed with its token ids (the path's reader, ``_STREAMS``), checked against the loop
        rule every ``loops.CHECK_EVERY`` tokens; when it fires the connection is closed (vLLM's and SGLang's
        servers abort the request) and the answer is cut where the rule first fired, finish reason ``loop``.
        Answers as the server's whole JSON would, so the caller parses both alike."""
        stream = _STREAMS[path](watch)
        async with self._client.stream("POST", url + path, json=stream.streamed(body)) as response:
            if response.status_code >= 400:
                answer = (await response.aread()).decode(errors="replace")
                raise _refused(response.status_code, answer)
            async with contextlib.aclosing(response.aiter_lines()) as lines:  # closed here when cut short
                async for line in lines:
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    try:
                        cut = stream.read(_json_chunk(line[6:]))
                    except sglang_wire.MalformedChunk as e:
                        raise Malformed(str(e)) from None
                    except sglang_wire.Refused as e:  # what the whole request's status would have said
                        raise _refused(e.status_code, e.detail) from None
                    if cut is not None:
                        return cut
        return stream.whole()

    async def _call(
        self,
        url: str,
        path: str,
        body: dict[str, Any] | None,
        retries: int | None = None,
        parse: Callable[[Any], T] | None = None,
        deadline: float | None = None,
        watch: LoopRule | None = None,
    ) -> Any:
        """GET (no body) or POST, parsed by ``parse``; faults retried with backoff within a total deadline each."""
        import httpx

        attempts = (self.opts["retries"] if retries is None else retries) + 1
        deadline = deadline or self.opts["timeout"]
        delay = self.opts["backoff"]
        last, status = "", 0
        for attempt in range(attempts):
            try:
                answer = await asyncio.wait_for(self._attempt(url, path, body, watch), deadline)
                return answer if parse is None else _parsed(parse, answer)
            except _Retry as e:
                last, status = str(e), e.status
            except Malformed as e:
                last, status = str(e), 0
            except Aborted as e:
                if attempt + 1 == attempts:
                    return e.result  # the server keeps giving up on this request: an abort row
                last, status = str(e), 0
            except (asyncio.TimeoutError, TimeoutError):
                last, status = f"no complete answer within the deadline of {deadline:g}s", 0
            except httpx.TransportError as e:  # refused, reset, closed mid-body, ...
                last, status = f"{type(e).__name__}: {e}", 0
            if attempt + 1 < attempts:
                log.warning("%s%s failed (%s); retry %d/%d in %.1fs", url, path, last, attempt + 1, attempts - 1, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.opts["max_backoff"])
        message = f"server {url} failed {path} after {attempts} attempts; last answer: {last}"
        if status:
            raise ServerError(status, message)
        down = ServerDown(message)
        down.timed_out = last.startswith("no complete answer within the deadline")
        raise down

    async def _health(self, url: str) -> None:
        try:
            await self._call(url, "/v1/models", None, retries=2, deadline=self.probe_seconds)
        except RequestRefused:
            pass  # it answers: some servers have no /v1/models
        except ServerDown as e:
            if self.pool is not None:
                raise
            raise ServerDown(f"config key 'engine.options.urls': {e}") from e

    async def _one(self, url: str, request: Request) -> Result:
        try:
            if self.opts["api"] == "generate":
                return await self._native(url, request)
            return await self._completion(url, request)
        except RequestRefused as e:
            return Result(request.prompt_id, request.sample_idx, [], "error", error=f"{url}: {e}")

    async def _native(self, url: str, request: Request) -> Result:
        def parse(out: Any) -> Result:
            out = out[0] if isinstance(out, list) and out else out
            if not isinstance(out, dict) or not isinstance(out.get("output_ids"), list):
                raise Malformed(f"not a /generate answer (no output_ids): {json.dumps(out)[:_SHOWN]}")
            return self._checked(request, parse_output(request, out, self.stop_token_ids), out)

        body = generate_body(request, self.stop_token_ids, self.loops_in_request)
        watch = None if self.loops_in_request else request.stop_loops  # streamed and closed where the rule fires
        return await self._call(url, "/generate", body, parse=parse, watch=watch)

    async def _completion(self, url: str, request: Request) -> Result:
        if self.prompt_mode == "auto":
            # Probe once, without retries: some servers refuse token-id prompts with a 4xx, others
            # (llama.cpp) with a 500 validation error. If the same request then works as text, the
            # server is text-only; if it does not, the first error stands.
            try:
                result = await self._post_completion(url, request, request.prompt_ids, retries=0)
            except HTTPFailure as refused:
                if refused.status not in _REFUSAL_STATUS:
                    raise
                try:
                    result = await self._text_completion(url, request)
                except HTTPFailure:
                    raise refused from None
                if self.prompt_mode == "auto":  # one event loop: no other task runs between these lines
                    log.warning("%s refuses token-id prompts (%s): sending rendered text from now on", url, refused)
                    self.prompt_mode = "text"
                return result
            if self.prompt_mode == "auto":
                self.prompt_mode = "ids"
            return result
        if self.prompt_mode == "ids":
            return await self._post_completion(url, request, request.prompt_ids)
        return await self._text_completion(url, request)

    async def _text_completion(self, url: str, request: Request) -> Result:
        text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        return await self._post_completion(url, request, text)

    async def _post_completion(
        self, url: str, request: Request, prompt: list[int] | str, retries: int | None = None
    ) -> Result:
        """POST /v1/completions; a server that refuses top_k -1 gets 0 ("disabled" too) from then on."""
        off = self.top_k_off.get(url, TOP_K_OFF[0])
        body = completions_body(request, await self._model_name(url), prompt, self.stop_token_ids, off)

        def parse(out: Any) -> Result:
            return self._parse_completion(request, out)

        watch = request.stop_loops  # set only for a backend that stops loops (Backend.stops_loops)
        if watch is not None:
            # the engine's own first stop (vLLM's scheduler, every step): a closed stream alone reaches a
            # loaded server after it has generated on, up to the whole budget (loops.engine_check)
            body["repetition_detection"] = loops.engine_check(watch)
        try:
            return await self._call(url, "/v1/completions", body, retries, parse, watch=watch)  # type: ignore[no-any-return]
        except HTTPFailure as e:
            if body["top_k"] != TOP_K_OFF[0] or "top_k" not in str(e):
                raise
            if url not in self.top_k_off:
                log.warning("%s refuses top_k %d (%s): sending %d for no top-k", url, off, e, TOP_K_OFF[1])
            self.top_k_off[url] = TOP_K_OFF[1]
            body["top_k"] = TOP_K_OFF[1]
            return await self._call(url, "/v1/completions", body, retries, parse, watch=watch)  # type: ignore[no-any-return]

    def _parse_completion(self, request: Request, out: Any) -> Result:
        """A /v1/completions answer as a Result; anything else is Malformed (retried, never stored)."""
        choices = out.get("choices") if isinstance(out, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise Malformed(f"no choices in the answer: {json.dumps(out)[:_SHOWN]}")
        choice = choices[0]
        reason = choice.get("finish_reason")
        usage = out.get("usage")
        server_count = usage.get("completion_tokens") if isinstance(usage, dict) else None
        ids = choice.get("token_ids")
        retokenized = ids is None
        if retokenized:
            text = choice.get("text")
            if not isinstance(text, str):
                raise Malformed(f"a choice with neither token_ids nor text: {json.dumps(choice)[:_SHOWN]}")
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise Malformed(f"token_ids are not a list of ints: {json.dumps(choice)[:_SHOWN]}")
        ids = list(ids)
        if reason == "stop":
            # Text answers carry no stop token; the server stopped on the model's end of turn.
            stop = ids.pop() if ids and ids[-1] in self.stop_token_ids else self.stop_token_ids[0]
            if server_count is not None and retokenized:
                server_count -= 1  # the server counts the stop token it emitted
            result = Result(request.prompt_id, request.sample_idx, ids, "stop", stop, None, retokenized, server_count)
        elif reason == "length":
            result = Result(request.prompt_id, request.sample_idx, ids, "length", None, None, retokenized, server_count)
        elif reason == "loop":  # ours: the stream was closed where the loop rule fired (_streamed)
            result = Result(request.prompt_id, request.sample_idx, ids, "loop")
        elif reason == "repetition":  # vLLM's check (loops.engine_check) unseen by the rule: not by its design
            why = "the engine stopped the row on its repetition check where the loop rule does not fire"
            result = Result(request.prompt_id, request.sample_idx, ids, "abort", error=why)
        else:
            result = Result(request.prompt_id, request.sample_idx, ids, "abort", error=f"finish_reason {reason!r}")
        counted = completion_acceptance(out)
        if counted is not None:
            result = dataclasses.replace(result, acceptance=counted)
        return self._checked(request, result, out)

    def _checked(self, request: Request, result: Result, out: Any) -> Result:
        """Refuse more tokens than asked for (a server that ignores max_tokens); retry what aborted."""
        limit = request.params.max_new_tokens
        # a re-tokenized answer may come out a token or two longer than the server's own count
        counted = result.engine_output_tokens if result.retokenized else len(result.output_ids)
        if counted is not None and counted > limit:
            raise Malformed(f"{counted} tokens for max_tokens {limit}: {json.dumps(out)[:_SHOWN]}")
        if result.finish_reason == "abort":
            raise Aborted(result)
        return result


class _Retry(Exception):
    """A status worth asking again (busy, overloaded, a gateway in between)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _refused(status: int, answer: str) -> Exception:
    """A streamed request's error status (its response's, or the one a chunk names) as a whole one's."""
    if status not in _RETRY_STATUS:
        return RequestRefused(status, answer)
    return _Retry(f"HTTP {status}: {answer[:_SHOWN]}", status)


def _json_chunk(data: str) -> dict[str, Any]:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise Malformed(f"a streamed chunk that is not JSON: {data[:_SHOWN]!r}") from None
    if not isinstance(chunk, dict):
        raise Malformed(f"a streamed chunk that is not an object: {data[:_SHOWN]!r}")
    return chunk


def _parsed(parse: Callable[[Any], T], answer: Any) -> T:
    """``parse(answer)``; an answer of an unexpected shape is Malformed (retried), not a crash."""
    try:
        return parse(answer)
    except (Malformed, Aborted):
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise Malformed(f"unexpected answer ({type(e).__name__}: {e}): {json.dumps(answer)[:_SHOWN]}") from e
