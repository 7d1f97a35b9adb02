"""Every backend, one descriptor each, found in its own module of ``dflash_build.engines.backends``.

A :class:`Backend` says what an engine is: its options (each with its default, the key it enters and
why), how a job loads it in its own process, how a host runs it as a server, whether its jobs take a
GPU, and the env its generate jobs run in. Every other layer reads the descriptor: the plan keys the
options it marks as keyed (:func:`keyed_options`), the host launches what it does not mark as the
driver's, the config check refuses what it does not list. A new backend is one module in
``engines/backends/`` defining ``BACKEND`` (and its name in the schema's enum); its engine library is
imported only inside its functions, so parsing the workflow never needs an optional engine.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_build import discovery
from dflash_build.engines.base import Engine, closest
from dflash_build.keys import GEN
from dflash_build.spec import ConfigError

if TYPE_CHECKING:
    from dflash_build.engines.gpus import GpuLease
    from dflash_build.spec import Config, Degenerate, DrafterSpec, EngineSpec, LoopRule, ModelSpec

# The reasons most options share.
NUMERICS = "changes the numbers the model computes, so the answers"
SPEED = "changes speed or memory only"
KERNELS = "kernels of the same computation; rounding differs, the distribution does not"
FAULTS = "fault handling only"


@dataclass(frozen=True)
class Derived:
    """A default that follows other options (the transformers dtype follows the device)."""

    of: Callable[[Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Option:
    """One engine option: the key it enters (``keys.GEN`` or None) and why, its default (None: the
    engine's own, which no key can name), and whether it belongs to the driver (how a job talks to the
    engine: not passed to the server, not part of an engine's identity)."""

    key: str | None
    why: str
    default: Any = None
    driver: bool = False


@dataclass(frozen=True)
class Serve:
    """The command a host runs for one engine server: ``argv(model, options, stop_ids, port, context, lease)``
    (``options``: all of them; what the server is given is :meth:`Backend.engine_options`)."""

    argv: Callable[[ModelSpec, Mapping[str, Any], list[int], int, int | None, GpuLease | None], list[str]]
    health_path: str = "/health"
    api: str = "generate"  # the openai client's API for it (dflash_build.engines.openai_backend.APIS)
    concurrency: Callable[[Mapping[str, Any]], int] = lambda options: 2  # requests in flight per job
    env: Callable[[Mapping[str, Any]], dict[str, str]] = lambda options: {}  # the server's environment, beyond its GPU
    # Where a looping row stops (Request.stop_loops): the rule goes in the request and the server stops the row
    # itself (ours, dflash_build.engines.server), or the client streams the answer and closes it where the rule
    # fires (vLLM's and SGLang's servers, which abort a request whose client goes)
    loops_in_request: bool = False


@dataclass(frozen=True)
class Speculative:
    """How a backend's server drafts (``stages.accept``): ``check(key, drafter)`` refuses a method or an
    option its pinned release does not have (naming the closest), and ``options(drafter)`` gives the
    engine options that serve the target with that drafter and report each request's acceptance."""

    check: Callable[[str, DrafterSpec], None]
    # (drafter, per_step): per_step asks each answer for its verify steps in order where the engine can
    options: Callable[[DrafterSpec, bool], dict[str, Any]]
    # The server's own totals from its /metrics text (steps, drafted, accepted, per_position); None: it
    # has none to check the requests' counts against.
    totals: Callable[[str], dict[str, Any]] | None = None
    # Methods whose drafter must share the target's vocabulary, as the engine checks when its server starts
    # (vLLM's draft_model: "Target and draft model should have the same vocabulary size"): checked at parse time.
    same_vocabulary: frozenset[str] = frozenset()
    # The drafter that is the target itself with ``k`` draft tokens (the engine's calibration), and a
    # drafter's draft length (its k, whose k + 1 is τ's ceiling; None where its options do not say).
    self_drafter: Callable[[str, int], DrafterSpec] | None = None
    draft_tokens: Callable[[DrafterSpec], int | None] = lambda drafter: None
    # What the pinned engine is known to get wrong under speculation at a sampling, on these options (one
    # line naming the setting that works), or None: `plan` says it before any server starts.
    known_broken: Callable[[Mapping[str, Any], Mapping[str, Any]], str | None] = lambda options, sampling: None


@dataclass(frozen=True)
class Preflight:
    """What `preflight` asks of a backend before the build (``stages.preflight``): the Python package its
    engine is (its version, from the interpreter it runs under), what its server says about itself in its
    log (``report(log_text)``: ``kv_tokens``, the KV cache's tokens, ``kernels``, the backends it chose, and
    ``lines``, the log lines read), the setting that sizes its KV cache, what a hybrid target (linear
    attention with a recurrent state) needs of its options (one line naming the setting, or None), and its
    load while the pilot runs."""

    package: str
    python: Callable[[Mapping[str, Any]], str]
    report: Callable[[str], dict[str, Any]] = lambda log: {}
    memory_knob: Callable[[Mapping[str, Any]], str] = lambda options: ""
    hybrid: Callable[[Mapping[str, Any]], str | None] = lambda options: None
    # The server's load from its /metrics text: requests ``running`` and ``waiting``, ``kv_usage`` (0-1);
    # None: it exposes none
    load: Callable[[str], dict[str, float]] | None = None
    # the engine option that caps the requests it runs at once (vLLM max_num_seqs); None: it has none
    batch_cap_option: str | None = None

    def batch_cap(self, options: Mapping[str, Any]) -> int | None:
        """The requests the engine runs at once at most, where its options set it (None: its own default)."""
        value = options.get(self.batch_cap_option) if self.batch_cap_option else None
        return None if value is None else int(value)


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)")


def gauges(metrics: str, names: Mapping[str, str]) -> dict[str, float]:
    """Prometheus samples by our name (``names``: ours -> the server's), summed over their label sets."""
    ours = {theirs: mine for mine, theirs in names.items()}
    found: dict[str, float] = {}
    for line in metrics.splitlines():
        if (m := _SAMPLE.match(line)) is not None and m.group(1) in ours:
            found[ours[m.group(1)]] = found.get(ours[m.group(1)], 0.0) + float(m.group(2))
    return found


@dataclass(frozen=True)
class Backend:
    name: str
    options: Mapping[str, Option]
    # In-process: load(engine, model, stop_ids, lease, tokenizer) -> Engine; None where it only runs served.
    load: Callable[[EngineSpec, ModelSpec, list[int], GpuLease | None, Any], Engine] | None
    serve: Serve | None  # how a host runs it as a server (engine.shared); None: it cannot be served
    uses_gpu: Callable[[EngineSpec], bool]  # whether its jobs take a GPU (rule resource gpu=1)
    always_through_server: bool = False  # no in-process engine: every job talks to a host's server
    remote: bool = False  # a client of servers over HTTP: their health check, not a step count, tells a stall
    conda_env: str = "generate"  # envs/NAME.yaml of its generate jobs
    # The modules whose third-party imports (its engine library) only its env has (tests/test_envs.py).
    env_only: tuple[str, ...] = ()
    # The decision for an option ``options`` does not list: None refuses it (closest name given); SGLang
    # passes any ServerArgs field through, keyed, since one not decided might change the answers.
    undecided: Option | None = None
    # A check of the option names beyond ``options`` (the engine's own argument list), at parse time.
    check_names: Callable[[Mapping[str, Any]], None] | None = None
    # Cores a job asks Snakemake for (the rule's threads:).
    threads: Callable[[Mapping[str, Any]], int] = field(default=lambda options: 1)
    speculative: Speculative | None = None  # None: its server cannot serve a drafter
    # it stops a row when Request.stop_loops fires (in its decoding loop, or its server's); others answer
    # whole and tokenize drops the loop after the fact
    stops_loops: bool = False
    # Whether this machine can run the engine as configured (its device, its interpreter): a look of
    # milliseconds at parse time that names the setting to use, instead of a job that fails (engine checks).
    environment: Callable[[EngineSpec], None] | None = None
    preflight: Preflight | None = None  # None: preflight checks its model and pilot, not its engine's package
    # What these options cannot serve of a hybrid target (linear attention with a recurrent state; one line
    # naming the setting), refused at parse time, or None (preflight still says what it needs)
    refuses_hybrid: Callable[[Mapping[str, Any]], str | None] = field(default=lambda options: None)

    def decision(self, name: str) -> Option | None:
        """The decision for one option; None for a name this backend does not accept."""
        return self.options.get(name, self.undecided)

    def value(self, options: Mapping[str, Any], name: str) -> Any:
        """An option's effective value: the one given, else its default (None: the engine's own)."""
        if name in options:
            return options[name]
        default = self.options[name].default
        return default.of(options) if isinstance(default, Derived) else default

    def keyed(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options that enter gen_key, with their effective values: each keyed option given, and each
        keyed option with a default of its own (so spelling out a default changes no key)."""
        keyed = {}
        for name in sorted(set(options) | set(self.options)):
            decision = self.decision(name)
            if decision is None or decision.key != GEN:
                continue
            value = self.value(options, name) if name in self.options else options[name]
            if name in options or value is not None:
                keyed[name] = value
        return keyed

    def engine_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """What the engine itself is given (and what its identity holds): the options but the driver's."""
        return {k: v for k, v in options.items() if not (k in self.options and self.options[k].driver)}

    def check(self, options: Mapping[str, Any]) -> None:
        """Refuse an option this backend does not know, naming the closest one (at parse time: no engine
        library is imported, so a typo stops the run before any job)."""
        if self.check_names is not None:
            self.check_names(options)
            return
        for name in sorted(options):
            if self.decision(name) is None:
                raise ConfigError(
                    f"engine.options.{name}", f"the {self.name} backend has no such option{closest(name, self.options)}"
                )


_REGISTRY = discovery.Registry[Backend]("dflash_build.engines.backends", "BACKEND")
__getattr__ = _REGISTRY.view("BACKENDS")  # every backend, by name


def get(name: str) -> Backend:
    backends = _REGISTRY.found
    try:
        return backends[name]
    except KeyError:
        raise ConfigError("engine.backend", f"unknown backend '{name}'{closest(name, backends)}") from None


def loop_stop(engine: EngineSpec, degenerate: Degenerate) -> LoopRule | None:
    """The loop rule the engine stops rows on (``degenerate.loop``) where its backend can (``stops_loops``);
    None where answers run whole (tokenize drops a loop after the fact, on the same rule)."""
    rule = degenerate.stopping
    return rule if rule is not None and get(engine.backend).stops_loops else None


def check_options(backend: str, options: Mapping[str, Any]) -> None:
    get(backend).check(options)


def check(engine: EngineSpec) -> None:
    """The config's engine section against its backend, before any job: options, whether it can be
    shared, and the drafter that serves generation."""
    backend = get(engine.backend)
    backend.check(engine.options)
    if engine.shared and backend.serve is None:
        raise ConfigError("engine.shared", f"the {backend.name} backend talks to servers it does not run; remove it")
    if engine.drafter is not None:
        speculative = _speculative(backend, "engine.drafter")
        speculative.check("engine.drafter", engine.drafter)
        own = sorted(set(speculative.options(engine.drafter, True)) & set(engine.options))
        if own:
            raise ConfigError(f"engine.options.{own[0]}", "engine.drafter sets it: remove it here")


def _speculative(backend: Backend, key: str) -> Speculative:
    if backend.speculative is None:
        able = sorted(name for name, b in _REGISTRY.found.items() if b.speculative is not None)
        raise ConfigError(key, f"engine.backend {backend.name!r} cannot serve a drafter; use {' or '.join(able)}")
    return backend.speculative


def check_generation_drafter(engine: EngineSpec, samplings: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse generation with ``engine.drafter`` under a sampling (by its config key) that the pinned
    engine is shown to get wrong under speculation: its rows would not be the target's."""
    if engine.drafter is None:
        return
    speculative = _speculative(get(engine.backend), "engine.drafter")
    for key, sampling in samplings.items():
        if (why := speculative.known_broken(engine.options, sampling)) is not None:
            raise ConfigError(key, f"engine.drafter cannot serve this sampling: {why}")


def for_generation(engine: EngineSpec) -> EngineSpec:
    """The engine generation runs: with ``engine.drafter`` its options serve the target with that drafter
    and report each answer's verify steps (shared or not, as configured)."""
    if engine.drafter is None:
        return engine
    speculative = _speculative(get(engine.backend), "engine.drafter")
    return dataclasses.replace(engine, options={**engine.options, **speculative.options(engine.drafter, True)})


def check_environment(engine: EngineSpec) -> None:
    """Whether this machine can start the configured engine (`plan` and the workflow's parse, not every
    plan: a job on a node of its own sees its own)."""
    backend = get(engine.backend)
    if backend.environment is not None:
        backend.environment(engine)


# The model types whose layers keep a recurrent state per request (linear attention), also where their
# config.json lists no layer_types
HYBRID_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text"})


def is_hybrid(model_config: Mapping[str, Any]) -> bool:
    """Whether a model's config.json is a hybrid's: linear-attention layers beside full attention."""
    text = model_config.get("text_config") or model_config
    return "linear_attention" in (text.get("layer_types") or []) or model_config.get("model_type") in HYBRID_TYPES


def check_serving(config: Config) -> None:
    """The engine against what it serves, before any job: a hybrid target on these options, engine.drafter
    against the sources' samplings, and `accept`'s drafters against the engine's pinned release."""
    engine, accept = config.engine, config.accept
    try:  # a folder whose config.json is missing or broken: the engine, or preflight, says so
        hybrid = is_hybrid(json.loads((Path(config.model.path) / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        hybrid = False
    if hybrid and (why := get(engine.backend).refuses_hybrid(engine.options)) is not None:
        raise ConfigError("engine.options.enable_prefix_caching", why)
    samplings = {f"sources.{s.config_name}.sampling": s.sampling.as_dict() for s in config.sources.values()}
    check_generation_drafter(engine, samplings)
    if accept is None:
        return
    backend = get(engine.backend)
    speculative = _speculative(backend, "accept")
    backend.check({**engine.options, **accept.engine_options})
    for name, drafter in accept.drafters.items():
        speculative.check(f"accept.drafters.{name}", drafter)


def with_drafter(engine: EngineSpec, drafter: DrafterSpec, options: Mapping[str, Any]) -> EngineSpec:
    """The engine that serves the target with ``drafter`` (``options``: more engine options, accept's): a
    server of its own, never a shared one (another drafter is another server)."""
    speculative = get(engine.backend).speculative
    assert speculative is not None, "check_serving refuses a backend without speculation at parse time"
    served = {**engine.options, **options, **speculative.options(drafter, False)}
    # its options hold the drafter already: none left for for_generation to add
    return dataclasses.replace(engine, options=served, shared=False, drafter=None)


def draft_tokens(backend: str, drafter: DrafterSpec) -> int | None:
    """A drafter's draft length k on ``backend``'s engine (τ's ceiling is k + 1)."""
    speculative = get(backend).speculative
    return None if speculative is None else speculative.draft_tokens(drafter)


def keyed_options(backend: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The engine options that enter gen_key (:meth:`Backend.keyed`)."""
    return get(backend).keyed(options)
