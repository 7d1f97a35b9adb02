"""SGLang's request and result shapes: the in-process engine and the native ``/generate`` client
(openai backend, ``api: generate``) send and read the same ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dflash_build.engines.base import Acceptance, Request, Result


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
    if kind == "loop":  # our transformers server stopped it on the request's loop rule (never SGLang)
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
