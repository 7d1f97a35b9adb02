"""SGLang's request and result shapes: the in-process engine and the native ``/generate`` client
(openai backend, ``api: generate``) send and read the same ones, whole or streamed.

A request whose row the loop rule stops (``Request.stop_loops``) is streamed (:class:`GenerateStream`), as
SGLang 0.5.23 streams it (``sglang/srt``; lines of that release):

- ``/generate`` with ``"stream": true`` (``entrypoints/http_server.py:949-981``) answers server-sent events,
  ``data: <chunk as JSON>`` then a blank line, one per output the tokenizer manager yields, and
  ``data: [DONE]`` last; an error raised before the request runs (a prompt over the context) is one
  ``data: {"error": {"message", "type", "code"}}`` chunk. ``Engine.async_generate(..., stream=True)``
  (``entrypoints/engine.py:643-648``) yields the same chunks in the job.
- A chunk (``managers/tokenizer_manager.py:2675-2711``, token ids only: ``skip_tokenizer_init``) is
  ``{"output_ids", "meta_info"}``. ``output_ids`` is the answer so far or, on a server started with
  ``incremental_streaming_output`` (ours: ``sglang_backend.server_args``), only the tokens since the last
  chunk; ``meta_info.completion_tokens`` is the answer's length so far either way
  (``managers/scheduler_components/output_streamer.py:522``: ``len(output_ids_through_stop)``), which
  tells the two apart. ``finish_reason`` is null until the last chunk, which alone carries the
  speculative counts (``tokenizer_manager.py:2755``: ``_calculate_spec_decoding_metrics`` when finished).
  A chunk goes out every ``sampling_params.stream_interval`` tokens (``output_streamer.py:454-469``); we
  ask for one per loop check (``loops.CHECK_EVERY``).
- An abort with a status code (503 "retry later", 400) is the last chunk of a stream where a whole
  request raises it (``tokenizer_manager.py:1891-1922``, ``_handle_abort_finish_reason``): the reader
  raises it as the whole request's status (:class:`Refused`).
- A closed stream aborts the request: SGLang does it itself, so no ``/abort_request`` is sent. Starlette's
  ``StreamingResponse`` (uvicorn's ASGI ``spec_version`` 2.3) listens for the client's disconnect and
  cancels the stream, which ends the tokenizer manager's ``generate_request`` in its ``except
  BaseException`` (``tokenizer_manager.py:958-967``): ``_release_req_states_on_failure`` calls
  ``abort_request(rid)`` for a request already sent to the scheduler (``tokenizer_manager.py:3850-3866``).
  The response's background task, ``create_abort_task`` (``http_server.py:980``,
  ``tokenizer_manager.py:2427-2438``), aborts it again 2 s later if it is still there. In the job, closing
  the generator ends ``generate_request`` the same way; the backend also calls ``abort_request(rid)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dflash_build import loops
from dflash_build.engines.base import Acceptance, Request, Result
from dflash_build.spec import LoopRule


def sampling_params(request: Request, stop_token_ids: list[int]) -> dict[str, Any]:
    p = request.params
    return {
        "max_new_tokens": p.max_new_tokens,  # always: SGLang's default is 128
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,  # SGLang: -1 disables, 0 is invalid
        "min_p": p.min_p,
        # every knob that changes the distribution, so a server's preferred defaults never apply
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "min_new_tokens": 0,
        "stop_token_ids": list(stop_token_ids),
        "sampling_seed": request.seed,
        "skip_special_tokens": False,
    }


def parse_output(request: Request, out: Mapping[str, Any], stop_token_ids: list[int]) -> Result:
    """One engine output as a Result (:func:`_parse_finish`), with its speculative decoding counts where the
    server drafts (:func:`acceptance`)."""
    result = _parse_finish(request, out, stop_token_ids)
    counted = acceptance(out.get("meta_info") or {})
    return result if counted is None else dataclasses.replace(result, acceptance=counted)


def acceptance(meta_info: Mapping[str, Any]) -> Acceptance | None:
    """A speculative request's counts from SGLang's ``meta_info`` (``TokenizerManager``'s spec metrics:
    ``spec_verify_ct``, ``spec_num_proposed_drafts``, ``spec_num_correct_drafts`` and
    ``spec_correct_drafts_histogram``, steps by drafted tokens accepted); None without speculation."""
    steps = meta_info.get("spec_verify_ct")
    if not steps:
        return None
    histogram = tuple(int(n) for n in meta_info.get("spec_correct_drafts_histogram") or ())
    drafted = int(meta_info.get("spec_num_proposed_drafts") or 0)
    accepted = int(meta_info.get("spec_num_correct_drafts") or 0)
    return Acceptance(int(steps), drafted, accepted, histogram)


def _parse_finish(request: Request, out: Mapping[str, Any], stop_token_ids: list[int]) -> Result:
    """One engine output (``output_ids`` + ``meta_info.finish_reason``) as a Result.

    The shapes are SGLang's (``managers/schedule_batch.py``): ``FINISH_MATCHED_TOKEN`` is
    ``{"type": "stop", "matched": <token id>}`` with that id last in ``output_ids``;
    ``FINISH_MATCHED_STR`` is ``{"type": "stop", "matched": <str>}``: we send no stop strings, so it is
    SGLang's "NaN happened" (a sampled id out of the vocabulary, replaced by a stop id); ``FINISH_LENGTH``
    is ``{"type": "length", ...}``; ``FINISH_ABORT`` is ``{"type": "abort", "message", "status_code", ...}``.
    """
    output_ids = [int(t) for t in out.get("output_ids") or []]
    finish = (out.get("meta_info") or {}).get("finish_reason") or {}
    if not isinstance(finish, Mapping):
        finish = {"type": finish}
    kind, matched = finish.get("type"), finish.get("matched")
    stops = set(stop_token_ids)
    if kind == "stop" and isinstance(matched, str):
        return abort(request, f"engine fault: the answer ended on {matched!r}", output_ids)
    if kind == "stop":
        stop_id = matched if isinstance(matched, int) else None
        if output_ids and (output_ids[-1] == stop_id or output_ids[-1] in stops):
            stop_id = output_ids.pop()
        if stop_id is None:  # no stop id anywhere: we cannot say what ended the turn
            return abort(request, f"a stop without a stop token: {dict(finish)}", output_ids)
        return Result(request.prompt_id, request.sample_idx, output_ids, "stop", stop_token_id=stop_id)
    if kind == "loop":  # ours: cut where the loop rule fired (GenerateStream), or our transformers server's stop
        return Result(request.prompt_id, request.sample_idx, output_ids, "loop")
    if kind == "length":
        if output_ids and output_ids[-1] in stops:
            # SGLang before 0.5.6 checked the length limit before stop tokens: a stop sampled as the last
            # allowed token comes back as `length`. The model did end its turn.
            stop_id = output_ids.pop()
            return Result(request.prompt_id, request.sample_idx, output_ids, "stop", stop_token_id=stop_id)
        return Result(request.prompt_id, request.sample_idx, output_ids, "length")
    message = finish.get("message") or dict(finish) or "no finish reason"
    status = finish.get("status_code")
    return abort(request, f"engine aborted the request{f' ({status})' if status else ''}: {message}", output_ids)


def abort(request: Request, why: str, output_ids: list[int] | None = None) -> Result:
    return Result(request.prompt_id, request.sample_idx, output_ids or [], "abort", error=why)


class Refused(Exception):
    """What a whole request would have raised, met in a stream: an abort with a status code, or an error
    chunk (``status_code``: the HTTP status the whole request gets; ``detail``: SGLang's message)."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code, self.detail = status_code, detail


class MalformedChunk(Exception):
    """A streamed chunk that is not one of SGLang's."""


class GenerateStream:
    """One streamed answer, chunk by chunk (the shapes: this module's docstring), against the loop rule."""

    def __init__(self, rule: LoopRule) -> None:
        self.ids: list[int] = []
        self.meta: Mapping[str, Any] = {}
        self.watch = loops.Watch(rule)

    @staticmethod
    def streamed(body: Mapping[str, Any]) -> dict[str, Any]:
        """A ``/generate`` body (or ``async_generate``'s keyword arguments) streamed: a chunk per loop check."""
        params = {**body["sampling_params"], "stream_interval": loops.CHECK_EVERY}
        return {**body, "sampling_params": params, "stream": True}

    def read(self, chunk: Any) -> dict[str, Any] | None:
        """Take one chunk; once the rule has fired, the answer cut where it first fired (finish reason
        ``loop``, as a whole answer's shape), else None."""
        if not isinstance(chunk, Mapping):
            raise MalformedChunk(f"a streamed chunk that is not an object: {chunk!r:.300}")
        if isinstance(chunk.get("error"), Mapping):
            error = chunk["error"]
            raise Refused(int(error.get("code") or 400), str(error.get("message") or error))
        ids, meta = chunk.get("output_ids"), chunk.get("meta_info")
        if not isinstance(ids, list) or not isinstance(meta, Mapping) or "completion_tokens" not in meta:
            raise MalformedChunk(f"a streamed chunk without output_ids or meta_info.completion_tokens: {chunk!r:.300}")
        count = int(meta["completion_tokens"])
        if count == len(ids):  # the answer so far (or a first chunk)
            self.ids = [int(t) for t in ids]  # a copy: in the job it is SGLang's own growing list
        elif count == len(self.ids) + len(ids):  # the tokens since the last chunk
            self.ids += [int(t) for t in ids]
        else:
            raise MalformedChunk(f"{len(ids)} output_ids after {len(self.ids)} for completion_tokens {count}")
        self.meta = meta
        finish = meta.get("finish_reason")
        status = finish.get("status_code") if isinstance(finish, Mapping) and finish.get("type") == "abort" else None
        if isinstance(status, int) and 400 <= status < 600:  # as _handle_abort_finish_reason raises a whole one
            raise Refused(status, str(finish.get("message") or finish))
        end = self.watch.end(self.ids, last=finish is not None)
        if end is None:
            return None
        return {
            "output_ids": self.ids[:end],
            "meta_info": {"finish_reason": {"type": "loop"}, "completion_tokens": end},
        }

    def whole(self) -> dict[str, Any]:
        """The answer as the stream ended it, in a whole answer's shape (no finish reason: it was cut off)."""
        return {"output_ids": self.ids, "meta_info": dict(self.meta)}
