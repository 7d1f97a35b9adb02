"""Run in vLLM's own environment (``.venv-vllm``) by tests/test_vllm_contract.py: what the pinned vLLM makes
of the requests and the command line the vllm backend writes. Reads JSON on stdin, prints JSON."""

from __future__ import annotations

import json
import sys


def main() -> None:
    asked = json.load(sys.stdin)
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    parsed = vars(parser.parse_args(asked["argv"])) if asked["argv"] else {}
    requests, checks = [], []
    for body in asked["bodies"]:
        request = CompletionRequest.model_validate(body)
        params = request.to_sampling_params(body["max_tokens"], default_sampling_params={"temperature": 99.0})
        checks.append(params.repetition_detection)
        requests.append(
            {
                "unsent_defaults": sorted(k for k in request._DEFAULT_SAMPLING_PARAMS if body.get(k) is None),
                "params": {k: getattr(params, k) for k in asked["params"]},
                "return_token_ids": request.return_token_ids,
                "prompt_is_ids": request.prompt == body["prompt"],
            }
        )
    # vLLM's scheduler check of a request's repetition_detection on the given outputs: where it first stops
    stops = []
    if asked.get("outputs"):
        from vllm.v1.core.sched.utils import check_sequence_repetition

        for index, output in asked["outputs"]:
            check = checks[index]
            stopped = (n for n in range(1, len(output) + 1) if check_sequence_repetition(output[:n], check))
            stops.append(next(stopped, None))
    print(
        json.dumps(
            {
                "version": vllm.__version__,
                "parsed": {k: parsed[k] for k in asked["dests"]},
                "requests": requests,
                "stops": stops,
            },
            default=str,
        )
    )


if __name__ == "__main__":
    main()
