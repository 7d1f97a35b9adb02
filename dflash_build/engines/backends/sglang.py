"""sglang: one engine per GPU, in the job (``sglang.Engine``) or as SGLang's own HTTP server.

Any field of the pinned release's ``ServerArgs`` passes through as an option, except the few the driver
sets itself (``DRIVER_FIELDS``); one the table below does not decide is keyed (it might change the
answers, and keying it costs at most a rebuild). The pinned release's fields are recorded in
``sglang_fields`` (checked against the package by tests/test_sglang_contract.py), so a workflow parses
without importing SGLang.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_build import hashing
from dflash_build.engines import sglang_fields
from dflash_build.engines.base import closest
from dflash_build.engines.registry import (
    FAULTS,
    KERNELS,
    NUMERICS,
    SPEED,
    Backend,
    Option,
    Preflight,
    Serve,
    Speculative,
    gauges,
)
from dflash_build.keys import GEN
from dflash_build.spec import ConfigError, DrafterSpec

if TYPE_CHECKING:
    from dflash_build.engines.base import Engine
    from dflash_build.engines.gpus import GpuLease
    from dflash_build.spec import EngineSpec, ModelSpec

# ServerArgs fields the driver sets itself: the options cannot override them.
DRIVER_FIELDS: dict[str, str] = {
    "model_path": "set from model.path",
    "tokenizer_path": "set from model.tokenizer (or model.path)",
    "revision": "set from model.revision",
    "context_length": "set from model.context_length (the driver skips what does not fit)",
    "skip_tokenizer_init": "the driver renders and tokenizes prompts itself",
    "tp_size": "one engine per GPU job",
    "incremental_streaming_output": "the driver reads a streamed answer's chunks as its new tokens",
    "dp_size": "one engine per GPU job",
    "pp_size": "one engine per GPU job",
    "base_gpu_id": "the job's pinned GPU is device 0 of its process",
    "port": "set per GPU slot from engine.base_port",
    "nccl_port": "set per GPU slot from engine.base_port",
}


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_server_fields() -> frozenset[str]:
    """The fields of the installed SGLang's ``ServerArgs`` (imports SGLang: a few seconds)."""
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    return frozenset(f.name for f in record_fields(ServerArgs) if not f.name.startswith("_"))  # bookkeeping


def server_fields() -> tuple[str, frozenset[str]]:
    """(version, ServerArgs field names) of the SGLang the jobs will run: the pinned version's as
    recorded, another installed version's read from the package itself."""
    found = installed_version()
    if found is None or found == sglang_fields.VERSION:
        return sglang_fields.VERSION, sglang_fields.SERVER_ARGS
    return found, installed_server_fields()


def check_names(options: Mapping[str, Any]) -> None:
    """Refuse an option SGLang does not have (naming the closest field) or one the driver sets."""
    version, fields = server_fields()
    own = {name for name, option in BACKEND.options.items() if option.driver}
    for name in sorted(options):
        if name in own:
            continue
        if name in DRIVER_FIELDS:
            raise ConfigError(f"engine.options.{name}", f"{DRIVER_FIELDS[name]}; remove it from the options")
        if name not in fields:
            raise ConfigError(
                f"engine.options.{name}",
                f"SGLang {version} has no such ServerArgs field{closest(name, fields | own)}",
            )


def render_fields_module(version: str, fields: Iterable[str]) -> str:
    """The source of ``sglang_fields.py`` for one SGLang version's ServerArgs."""
    lines = [
        f'"""ServerArgs fields of SGLang {version}: generated from the installed package, do not edit.',
        "",
        "Regenerate after changing SGLANG_VERSION (tests/test_sglang_contract.py says when):",
        "    python -c 'from dflash_build.engines.backends import sglang; sglang.write_fields_module()'",
        '"""',
        "",
        f'VERSION = "{version}"',
        "SERVER_ARGS = frozenset(",
        "    {",
        *(f'        "{name}",' for name in sorted(fields)),
        "    }",
        ")",
    ]
    return "\n".join(lines) + "\n"


def write_fields_module() -> None:
    version = installed_version()
    if version is None:
        raise RuntimeError("SGLang is not installed (make setup installs the pinned wheel)")
    path = Path(sglang_fields.__file__)
    path.write_text(render_fields_module(version, installed_server_fields()))


def _load(engine: EngineSpec, model: ModelSpec, stop_ids: list[int], lease: GpuLease | None, tokenizer: Any) -> Engine:
    from dflash_build.engines.sglang_backend import SGLangEngine

    return SGLangEngine(model, engine.options, stop_ids, lease)


def _argv(
    model: ModelSpec, options: Mapping[str, Any], stop_ids: list[int], port: int, context: int | None, lease: Any
) -> list[str]:
    from dflash_build.engines.sglang_backend import server_kwargs

    kwargs = server_kwargs(model, options, lease, port)
    return [sys.executable, "-m", "dflash_build.engines.sglang_backend", "serve", hashing.canonical_json(kwargs)]


# SGLang 0.5.23's SpeculativeAlgorithm members (speculative/spec_info.py; tests/test_sglang_contract.py reads
# them from the pinned package), as `--speculative-algorithm` takes them; NONE is no drafter.
SPECULATIVE_ALGORITHMS = ("DFLASH", "DSPARK", "EAGLE", "EAGLE3", "FROZEN_KV_MTP", "NGRAM", "STANDALONE", "UNO")


def _check_drafter(key: str, drafter: DrafterSpec) -> None:
    if drafter.method.upper() not in SPECULATIVE_ALGORITHMS:
        raise ConfigError(
            f"{key}.method",
            f"SGLang {sglang_fields.VERSION} has no speculative algorithm {drafter.method!r}"
            + closest(drafter.method.upper(), SPECULATIVE_ALGORITHMS),
        )
    for name in sorted(drafter.options):
        if not name.startswith("speculative_") or name not in sglang_fields.SERVER_ARGS:
            known = {f for f in sglang_fields.SERVER_ARGS if f.startswith("speculative_")}
            raise ConfigError(
                f"{key}.options.{name}",
                f"SGLang {sglang_fields.VERSION} has no such speculative argument{closest(name, known)}",
            )


def _speculative_options(drafter: DrafterSpec, per_step: bool = False) -> dict[str, Any]:
    """``per_step``: SGLang 0.5.23 reports totals per request only (``meta_info``), never per step."""
    path = {"speculative_draft_model_path": drafter.path} if drafter.path else {}
    return {"speculative_algorithm": drafter.method.upper(), **path, **drafter.options}  # meta_info has the counts


# What SGLang logs about the memory it settled on ("max_total_num_tokens=..., max_running_requests=...",
# its "KV Cache is allocated. #tokens: ..."), and the attention backend it chose.
_KV_TOKENS = re.compile(r"max_total_num_tokens=(\d+)|KV Cache is allocated\. #tokens: (\d+)")
_SETTLED = re.compile(r"max_total_num_tokens=\d+[^\n]*")
_KERNELS = re.compile(r"(attention_backend='?\w+'?|Using [^\n]*?backend[^\n]*?)\s*$", re.M)


_LOAD = {"running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs", "kv_usage": "sglang:token_usage"}


def _self_report(log: str) -> dict[str, Any]:
    kv = [int(a or b) for a, b in _KV_TOKENS.findall(log)]
    kernels = sorted(set(_KERNELS.findall(log)))
    return {"kv_tokens": kv[-1] if kv else None, "kernels": kernels, "lines": _SETTLED.findall(log)[-1:]}


BACKEND = Backend(
    "sglang",
    options={
        "dtype": Option(GEN, NUMERICS, default="auto"),
        "quantization": Option(GEN, NUMERICS),
        "quantization_param_path": Option(GEN, NUMERICS),
        "kv_cache_dtype": Option(GEN, NUMERICS, default="auto"),
        "mamba_ssm_dtype": Option(GEN, "the precision of a hybrid model's recurrent state: " + NUMERICS),
        "enable_fp32_lm_head": Option(GEN, NUMERICS),
        "json_model_override_args": Option(GEN, "edits the model's config"),
        "load_format": Option(GEN, "which weights load ('dummy' is random weights)"),
        "lora_paths": Option(GEN, "adapters change the model"),
        "enable_deterministic_inference": Option(GEN, "whether the row seeds decide the answers", default=False),
        "random_seed": Option(GEN, "the engine's own random state, which decides answers without deterministic mode"),
        "attention_backend": Option(None, KERNELS),
        "decode_attention_backend": Option(None, KERNELS),
        "prefill_attention_backend": Option(None, KERNELS),
        "linear_attn_backend": Option(None, KERNELS),
        "mamba_backend": Option(None, KERNELS),
        "sampling_backend": Option(None, KERNELS),
        "mem_fraction_static": Option(None, SPEED),
        "max_running_requests": Option(None, SPEED),
        "max_total_tokens": Option(None, SPEED),
        "max_prefill_tokens": Option(None, SPEED),
        "chunked_prefill_size": Option(None, SPEED),
        "page_size": Option(None, SPEED),
        "cuda_graph_max_bs_decode": Option(None, SPEED),
        "cuda_graph_max_bs_prefill": Option(None, SPEED),
        "disable_cuda_graph": Option(None, SPEED),
        "schedule_policy": Option(None, SPEED),
        "schedule_conservativeness": Option(None, SPEED),
        "disable_overlap_schedule": Option(None, SPEED),
        "disable_radix_cache": Option(None, SPEED),
        "max_mamba_cache_size": Option(None, SPEED),
        "mamba_full_memory_ratio": Option(None, SPEED),
        "mamba_radix_cache_strategy": Option(None, SPEED),
        "watchdog_timeout": Option(None, FAULTS),
        "log_level": Option(None, "logging only", default="warning"),
        "trust_remote_code": Option(None, "the remote code itself is fingerprinted with the model (*.py)"),
        # ours: requests in flight in the engine at once, and how often a request SGLang turned away with
        # "retry later" (503 under memory pressure, 429) is sent again before it is an abort row
        "max_inflight": Option(None, SPEED, default=1024, driver=True),
        "retries": Option(None, FAULTS, default=3, driver=True),
    },
    load=_load,
    serve=Serve(_argv, concurrency=lambda options: int(BACKEND.value(options, "max_inflight"))),
    uses_gpu=lambda engine: True,
    preflight=Preflight(
        "sglang",
        lambda options: sys.executable,
        _self_report,
        lambda options: "engine.options.mem_fraction_static",
        # its /metrics, with enable_metrics: true
        load=lambda metrics: gauges(metrics, _LOAD),
        batch_cap_option="max_running_requests",
    ),
    conda_env="sglang",
    env_only=("dflash_build.engines.sglang_backend",),
    undecided=Option(GEN, "a ServerArgs field not decided here: keyed, it may change what the model writes"),
    check_names=check_names,
    # a looping row's answer is streamed and cut where the rule fires, its request aborted: in the job, and
    # from SGLang's server, which aborts a request whose stream the client closes (sglang_wire says where)
    stops_loops=True,
    # STANDALONE drafts with a small model of its own, verified token by token: the same vocabulary
    speculative=Speculative(
        _check_drafter,
        _speculative_options,
        same_vocabulary=frozenset({"STANDALONE"}),
        # a chain of k drafts (one candidate a step), verified with the target's bonus token: k + 1 tokens
        self_drafter=lambda path, k: DrafterSpec(
            "target-itself",
            "STANDALONE",
            path,
            {"speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1},
        ),
        draft_tokens=lambda drafter: drafter.options.get("speculative_num_steps"),
    ),
)
