"""SGLang backend: one in-process ``sglang.Engine`` per GPU job, token ids in and out.

The engine starts with ``skip_tokenizer_init=True``: the driver renders prompts, so the ids the model
sees are exactly the ids the sample holds. ``max_new_tokens`` is always sent (SGLang's default is
128). Each row's seed goes out as ``sampling_seed``; SGLang honours it only when the engine runs with
``enable_deterministic_inference`` (an engine option: it costs throughput), otherwise rows are sampled
from the engine's own random state and a rerun is not bit-identical.

SGLang cannot run on a CPU-only machine; ``server_args``, ``sampling_params`` and ``parse_output`` are
pure functions tested without it, and the engine call itself is the untested surface (README).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

from dflash_build.config import ModelSpec
from dflash_build.engines import Request, Result
from dflash_build.gpus import GpuLease

log = logging.getLogger(__name__)

# Engine options passed through to sglang.Engine (ServerArgs) unchanged.
PASSTHROUGH_OPTIONS = frozenset(
    {
        "mem_fraction_static",
        "max_running_requests",
        "chunked_prefill_size",
        "cuda_graph_max_bs",
        "schedule_conservativeness",
        "disable_radix_cache",
        "attention_backend",
        "context_length",
        "enable_deterministic_inference",
        "dtype",
        "kv_cache_dtype",
        "quantization",
        "random_seed",
        "log_level",
        "trust_remote_code",
        "disable_cuda_graph",
    }
)
# Our own options: how many requests are in flight in the engine at once.
OWN_OPTIONS = frozenset({"max_inflight"})
DEFAULT_MAX_INFLIGHT = 1024


def server_args(model: ModelSpec, options: Mapping[str, Any], lease: GpuLease | None) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for one single-GPU engine."""
    unknown = set(options) - PASSTHROUGH_OPTIONS - OWN_OPTIONS
    if unknown:
        raise ValueError(
            f"config key 'engine.options': unknown sglang options {sorted(unknown)} "
            f"(known: {sorted(PASSTHROUGH_OPTIONS | OWN_OPTIONS)})"
        )
    args: dict[str, Any] = {
        "model_path": model.path,
        "tokenizer_path": model.tokenizer or model.path,
        "skip_tokenizer_init": True,
        "tp_size": 1,
        # CUDA_VISIBLE_DEVICES holds exactly the pinned GPU, so it is device 0 in this process.
        "base_gpu_id": 0,
        "log_level": "warning",
    }
    if model.revision is not None:
        args["revision"] = model.revision
    if model.context_length is not None:
        args["context_length"] = model.context_length  # the driver skipped what does not fit
    if lease is not None:
        # Own ports per GPU slot: SGLang picks its NCCL port near its port unless told, and two
        # engines on one machine must not collide.
        args["port"] = lease.port
        args["nccl_port"] = lease.port + 1
    args.update({k: v for k, v in options.items() if k in PASSTHROUGH_OPTIONS})
    return args


def sampling_params(request: Request, stop_token_ids: list[int]) -> dict[str, Any]:
    p = request.params
    return {
        "max_new_tokens": p.max_new_tokens,  # always: SGLang's default is 128
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,  # SGLang: -1 disables, 0 is invalid
        "min_p": p.min_p,
        "stop_token_ids": list(stop_token_ids),
        "sampling_seed": request.seed,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token; parse_output moves it to stop_token_id
    }


def parse_output(request: Request, out: Mapping[str, Any], stop_token_ids: list[int]) -> Result:
    """One engine output (``output_ids`` + ``meta_info.finish_reason``) as a Result."""
    output_ids = [int(t) for t in out.get("output_ids") or []]
    finish = (out.get("meta_info") or {}).get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    if kind == "stop":
        matched = finish.get("matched") if isinstance(finish, Mapping) else None
        stop_id = matched if isinstance(matched, int) else None
        if output_ids and (output_ids[-1] == stop_id or (stop_id is None and output_ids[-1] in stop_token_ids)):
            stop_id = output_ids.pop()
        return Result(request.prompt_id, request.sample_idx, output_ids, "stop", stop_token_id=stop_id)
    if kind == "length":
        return Result(request.prompt_id, request.sample_idx, output_ids, "length")
    message = finish.get("message") if isinstance(finish, Mapping) else None
    return Result(
        request.prompt_id,
        request.sample_idx,
        output_ids,
        "abort",
        error=f"engine aborted the request: {message or finish}",
    )


class SGLangEngine:
    def __init__(
        self, model: ModelSpec, options: Mapping[str, Any], stop_token_ids: list[int], lease: GpuLease | None
    ) -> None:
        import sglang

        self.stop_token_ids = stop_token_ids
        self.max_inflight = int(options.get("max_inflight", DEFAULT_MAX_INFLIGHT))
        args = server_args(model, options, lease)
        log.info("starting sglang.Engine(%s)", args)
        self.engine = sglang.Engine(**args)

    async def _one(self, request: Request) -> Result:
        try:
            out = await self.engine.async_generate(
                input_ids=request.prompt_ids, sampling_params=sampling_params(request, self.stop_token_ids)
            )
        except Exception as e:  # one bad request must not fail the shard
            return Result(request.prompt_id, request.sample_idx, [], "error", error=f"{type(e).__name__}: {e}")
        return parse_output(request, out, self.stop_token_ids)

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Keep ``max_inflight`` requests in the engine; yield each as it finishes."""
        loop = self.engine.loop
        todo = iter(requests)
        pending = {loop.create_task(self._one(r)) for r in islice(todo, self.max_inflight)}
        while pending:
            done, pending = loop.run_until_complete(asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))
            for task in done:
                yield task.result()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.add(loop.create_task(self._one(nxt)))

    def close(self) -> None:
        self.engine.shutdown()
