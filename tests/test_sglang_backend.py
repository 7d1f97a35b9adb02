"""Request building and result parsing around sglang.Engine (SGLang itself cannot run here)."""

from __future__ import annotations

import pytest

from dflash_build.config import ModelSpec
from dflash_build.engines import Request, SamplingParams
from dflash_build.engines.sglang_backend import parse_output, sampling_params, server_args
from dflash_build.gpus import GpuLease

MODEL = ModelSpec("/models/qwen", None, None, None, {})
REQUEST = Request("p", 1, [1, 2, 3], SamplingParams(0.6, 0.95, 0, 0.0, 8192), seed=99)


def test_server_args_pin_ports_and_pass_options_through() -> None:
    lease = GpuLease("3", 3, 31030, "lock", 0.0)
    args = server_args(MODEL, {"mem_fraction_static": 0.85, "enable_deterministic_inference": True}, lease)
    assert args["skip_tokenizer_init"] is True and args["tp_size"] == 1 and args["base_gpu_id"] == 0
    assert (args["port"], args["nccl_port"]) == (31030, 31031)
    assert args["mem_fraction_static"] == 0.85 and args["enable_deterministic_inference"] is True
    assert "max_inflight" not in server_args(MODEL, {"max_inflight": 8}, None)
    with pytest.raises(ValueError, match="mem_fraction"):
        server_args(MODEL, {"mem_fraction": 0.8}, None)


def test_sampling_params_always_carry_max_new_tokens_and_the_row_seed() -> None:
    params = sampling_params(REQUEST, [151645])
    assert params["max_new_tokens"] == 8192 and params["sampling_seed"] == 99
    assert params["top_k"] == -1, "0 (disabled here) is -1 for SGLang"
    assert params["stop_token_ids"] == [151645]


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        (
            {"output_ids": [5, 6, 7], "meta_info": {"finish_reason": {"type": "stop", "matched": 7}}},
            ([5, 6], "stop", 7, None),
        ),
        (
            {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 9}}},
            ([5, 6], "stop", 9, None),
        ),
        ({"output_ids": [5, 2], "meta_info": {"finish_reason": {"type": "stop"}}}, ([5], "stop", 2, None)),
        (
            {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2}}},
            ([5, 6], "length", None, None),
        ),
        (
            {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "prompt too long"}}},
            ([], "abort", None, "engine aborted the request: prompt too long"),
        ),
    ],
)
def test_parse_output(out: dict, expected: tuple) -> None:
    r = parse_output(REQUEST, out, [2])
    assert (r.output_ids, r.finish_reason, r.stop_token_id, r.error) == expected
    assert (r.prompt_id, r.sample_idx) == ("p", 1)
