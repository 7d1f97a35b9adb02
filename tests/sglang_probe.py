"""Run our SGLang arguments through the installed SGLang's own classes, in a process of its own.

Importing SGLang patches transformers process-wide, so the contract tests ask this script (a fresh
interpreter) instead of importing it themselves. Reads JSON on stdin:
``{"server_args": [kwargs, ...], "sampling": [params, ...], "vocab_size": N, "tool_calls": [case, ...],
"generate_bodies": [body, ...]}``; writes JSON on stdout: the version, the ServerArgs fields, for each
server_args, sampling and /generate body input ``null`` (accepted) or the error SGLang raised, and for
each tool-call case (``{"parser", "text", "tools"}``) what SGLang's detector of that name parses:
``{"content", "calls": [[name, arguments]]}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def check_server_args(kwargs: dict[str, Any]) -> str | None:
    """Construct ServerArgs as sglang.Engine does, then check each value against its field's type
    and choices (what SGLang's CLI parser and resolution would refuse)."""
    import msgspec
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    try:
        ServerArgs(**kwargs)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    fields = {f.name: f for f in record_fields(ServerArgs)}
    for name, value in kwargs.items():
        annotated = fields[name].type
        inner = getattr(annotated, "__origin__", annotated)
        try:
            msgspec.convert(value, inner)
        except (msgspec.ValidationError, TypeError) as e:
            return f"{name}={value!r}: {e}"
        for meta in getattr(annotated, "__metadata__", ()):
            choices = getattr(meta, "choices", None)
            if isinstance(choices, (list, tuple)) and value is not None and value not in choices:
                return f"{name}={value!r} is not one of {list(choices)}"
    return None


def check_sampling(params: dict[str, Any], vocab_size: int) -> str | None:
    """Build SamplingParams as the tokenizer manager does, then its own normalize() and verify()."""
    import msgspec
    from sglang.srt.sampling.sampling_params import SamplingParams

    types = {f.name: f.type for f in msgspec.structs.fields(SamplingParams)}
    try:
        for name, value in params.items():
            msgspec.convert(value, types[name]) if name in types else None
        sp = SamplingParams(**params)
        sp.normalize(None)
        sp.verify(vocab_size)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def parse_tool_calls(case: dict[str, Any]) -> dict[str, Any]:
    """One answer through SGLang's own detector (``detect_and_parse``, what the server runs on a whole answer)."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.hermes_detector import HermesDetector
    from sglang.srt.function_call.qwen3_coder_detector import Qwen3CoderDetector

    detector = {"hermes": HermesDetector, "qwen3_coder": Qwen3CoderDetector}[case["parser"]]()
    tools = [Tool(**t) for t in case["tools"]]
    result = detector.detect_and_parse(case["text"], tools)
    return {"content": result.normal_text, "calls": [[c.name, json.loads(c.parameters)] for c in result.calls]}


def check_generate_body(body: dict[str, Any], vocab_size: int) -> str | None:
    """A /generate body through the route's own schema check (``api_contract.generate_contract_error``, run
    on every body before GenerateReqInput serves it), then its sampling params through :func:`check_sampling`."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    return generate_contract_error(body) or check_sampling(body["sampling_params"], vocab_size)


def main() -> None:
    import importlib.metadata
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    request = json.load(sys.stdin)
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    answer = {
        "version": importlib.metadata.version("sglang"),
        "fields": sorted(f.name for f in record_fields(ServerArgs)),
        "server_args": [check_server_args(k) for k in request.get("server_args", [])],
        "sampling": [check_sampling(p, request.get("vocab_size", 151936)) for p in request.get("sampling", [])],
        "tool_calls": [parse_tool_calls(case) for case in request.get("tool_calls", [])],
        "generate_bodies": [
            check_generate_body(b, request.get("vocab_size", 151936)) for b in request.get("generate_bodies", [])
        ],
    }
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
