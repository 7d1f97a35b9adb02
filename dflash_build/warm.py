"""The warm job runner: local jobs done by forks of one process that holds their imports.

A job's script is a new Python process, and before any work it imports the package, pyarrow, pandas, a
tokenizer's library and its stage: most of the ~1 CPU-s a tokenize or generate job takes on the test
machine, where a build runs hundreds of such jobs and a test several builds. So a job hands itself to a
runner (this module, started by the first job that finds none, in a process group of its own, its stdio
closed): its Snakemake object, working directory, import path, stdin, stdout and stderr (``SCM_RIGHTS``),
over a unix socket. The runner forks; the fork joins the job's process group and does the job; the job's
process waits and exits as the fork did (its exit status, or the signal that ended it). Before it forks a
job of a rule, the runner imports what the rule's earlier jobs imported (once each); it never runs job code
itself. One runner serves every build of one kind (interpreter, environment, import path less the job's
own folders, terminal session, the package's code: :func:`runner_address`) and exits after
``IDLE_SECONDS`` with nothing to do, or with its session's leader where that is a Snakemake.

Signals are what they are without it: a fork is in its job's process group, so Ctrl-C, a SLURM preemption
and a kill of the group reach it as they reach a job; the job's own process ignores SIGINT, SIGTERM and
SIGHUP (the fork gets them from the group: relaying them would deliver them twice), and a SIGKILL of it
(what Snakemake's kill of a job sends) closes its connection, on which the runner SIGKILLs its fork. A fork
that dies by a signal makes its job's process die by the same one.

A job runs in a process of its own, as before, when ``DFLASH_BUILD_WARM=0``, in a SLURM job (one job per
Snakemake there), when its parent is not Snakemake, when the socket's folder is not the user's own, when
the runner cannot start and while a Python thread runs in the runner (a fork of a process with threads can
inherit a held lock): each a path that works, never an error.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import pickle
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

WARM_ENV = "DFLASH_BUILD_WARM"  # "0": every job in a process of its own
START_SECONDS = 30.0  # how long a job waits for the runner it started to listen, then runs itself
REQUEST_SECONDS = 10.0  # how long the runner waits for a connected job's request
IDLE_SECONDS = 20.0  # a runner with no job for this long exits (tests and reruns start builds back to back)
_WORD = struct.Struct("!q")
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # the job's process: the fork gets them from the group
_PER_JOB_VARIABLES = ("PWD", "OLDPWD", "PYTEST_CURRENT_TEST")  # set by a shell or pytest; no import reads them
_NOT_LOADED = ("__main__", "__mp_main__")  # a fork's own main module: never the runner's


def run(smk: Any, target: str) -> None:
    """Do this Snakemake job, ``target`` (``module:function``, called with ``smk``): in a fork of the warm
    runner of its kind, or in this process where none serves it."""
    address = runner_address()
    conn = connect(address) if address is not None else None
    status = delegate(conn, smk, target) if conn is not None else None
    if status is None:
        call(target, smk)
        return
    exit_as(status)


def call(target: str, *args: Any) -> None:
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(*args)


def runner_address() -> Path | None:
    """The socket of the runner that serves jobs like this one, or None where jobs run in processes of
    their own. Its name is a digest of all a fork takes from the runner rather than from its job (what its
    modules read when imported): the interpreter, the environment (less the variables that name the
    current folder or test), the import path less the job's own folders (its working directory's, the
    sources Snakemake caches for one run, relative ones), the terminal session (a fork joins its job's
    process group, which must be in the runner's session) and the package's code (an edit starts a new
    runner). So the builds of one user in one terminal, or of one test worker, share one runner."""
    if os.environ.get(WARM_ENV) == "0" or "SLURM_JOB_ID" in os.environ:
        return None
    try:
        if b"snakemake" not in Path(f"/proc/{os.getppid()}/cmdline").read_bytes():
            return None
        folder = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"dflash-warm-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None  # a folder another user made or opened: no job's stdio goes through it
        env = sorted(f"{k}={v}" for k, v in os.environ.items() if k not in _PER_JOB_VARIABLES)
        kind = [sys.executable, str(os.getsid(0)), *shared_path(), *code_stamp(), *env]
    except OSError:
        return None
    return folder / f"{hashlib.sha256(chr(0).join(kind).encode()).hexdigest()[:24]}.sock"


def shared_path() -> list[str]:
    """The import path a runner keeps: the job's own folders left out (its working directory, unless the
    package is imported from there, what Snakemake keeps under it or caches for one run): each fork
    imports from those itself."""
    cwd = os.getcwd()
    package_root = str(Path(__file__).parent.parent)
    own = [e for e in sys.path if e == cwd and e != package_root]
    own += [e for e in sys.path if e.startswith(os.path.join(cwd, ".snakemake")) or "snakemake-runtime-cache" in e]
    return [e for e in sys.path if os.path.isabs(e) and e not in own]


def code_stamp() -> list[str]:
    """The package's source files, each with its size and time of change (about 2 ms for all)."""
    root = Path(__file__).parent
    stamps = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                st = os.stat(os.path.join(folder, name))
                stamps.append(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns}")
    return stamps


def connect(address: Path) -> socket.socket | None:
    """A connection to the runner, started here if none listens yet (one job starts it: the others wait
    on its lock); None where it cannot start."""
    conn = _try_connect(address)
    if conn is not None:
        return conn
    try:
        with open(f"{address}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _try_connect(address) or _start(address)
    except OSError:
        return None


def _try_connect(address: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(address))
    except OSError:
        conn.close()
        return None
    return conn


def _start(address: Path) -> socket.socket | None:
    """Start the runner (a process group of its own: no job's group signal is meant for it) and connect."""
    code = (
        "import sys, json; sys.path[:] = json.loads(sys.argv[1]); import dflash_build.warm as w; w.serve(sys.argv[2])"
    )
    with open(f"{address}.log", "ab") as log:
        runner = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(shared_path()), str(address)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            close_fds=True,
            process_group=0,
            cwd="/",
        )
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and runner.poll() is None:
        conn = _try_connect(address)
        if conn is not None:
            return conn
        time.sleep(0.01)
    return None


def delegate(conn: socket.socket, smk: Any, target: str) -> int | None:
    """Hand the job to the runner and wait for its fork: the fork's exit code (negative: the signal that
    ended it), or None where the runner declines it (the job then runs here)."""
    request = {"target": target, "snakemake": smk, "cwd": os.getcwd(), "env": dict(os.environ)}
    request |= {"path": sys.path, "argv": sys.argv, "group": os.getpgrp(), "umask": _umask()}
    request["ignored"] = [sig for sig in signal.valid_signals() if signal.getsignal(sig) is signal.SIG_IGN]
    payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _IGNORED}  # from the handover on, the fork's
    with conn:
        try:
            socket.send_fds(conn, [_WORD.pack(len(payload))], [0, 1, 2])
            conn.sendall(payload)
            pid = _read_word(conn)
        except OSError:
            pid = 0
        if not pid:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
            return None
        try:
            return _read_word(conn)
        except OSError:
            _kill(pid)  # the runner died: its fork must not go on unwatched
            sys.exit(f"dflash-build: the warm job runner stopped while it ran job {pid}; run the build again")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def exit_as(status: int) -> None:
    """Exit as the fork did: with its code, or killed by its signal."""
    if status >= 0:
        sys.exit(status)
    _die_by(-status)
    sys.exit(128 - status)  # a signal it could not be killed by (never: the fork died of it)


def _die_by(sig: int) -> None:
    """Be killed by ``sig`` whatever this process's handler for it."""
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


def _read_word(conn: socket.socket) -> int:
    return int(_WORD.unpack(_read_exactly(conn, _WORD.size))[0])


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionResetError("the other end closed the connection")
        data += chunk
    return data


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(REQUEST_SECONDS)
    head, fds, _, _ = socket.recv_fds(conn, _WORD.size, 3)
    for fd in fds:  # no process the runner's imports start may hold a job's stdio
        os.set_inheritable(fd, False)
    try:
        payload = _read_exactly(conn, int(_WORD.unpack(head)[0]))
        conn.settimeout(None)
        return pickle.loads(payload), fds
    except BaseException:  # the job's stdio must not stay open here: its reader would wait for the runner
        for fd in fds:
            os.close(fd)
        raise


def serve(address: str) -> None:
    """The runner's main: serve jobs at ``address`` until none came for ``IDLE_SECONDS``."""
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    Runner(Path(address)).loop()


class Runner:
    """The forking loop: one thread, selecting over the listening socket, each fork's pidfd and each
    waiting job's connection."""

    def __init__(self, address: Path) -> None:
        self.address = address
        os.close(os.pidfd_open(os.getpid()))  # a kernel without pidfds: the runner ends, the jobs run themselves
        address.unlink(missing_ok=True)  # a runner that was killed: its starter holds the lock
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(address))
        self.listener.listen(64)
        self.inode = address.stat().st_ino
        self.forks: dict[int, tuple[int, str, socket.socket]] = {}  # pidfd → (pid, rule, the job's connection)
        self.gone: set[socket.socket] = set()  # connections of jobs killed while their fork ran
        self.learned: dict[str, set[str]] = {}  # rule → the modules its jobs imported
        self.idle_since = time.monotonic()
        self.leader = _snakemake_leader()
        self.leader_gone = False

    def loop(self) -> None:
        while self.forks or not (self.leader_gone or time.monotonic() - self.idle_since >= IDLE_SECONDS):
            conns = [conn for _, _, conn in self.forks.values() if conn not in self.gone]
            watched = [self.listener, *self.forks, *conns]
            watched += [self.leader] if self.leader is not None and not self.leader_gone else []
            wait = None if self.forks else max(0.0, IDLE_SECONDS - (time.monotonic() - self.idle_since))
            ready, _, _ = select.select(watched, [], [], wait)
            for item in ready:
                self.ready(item)
        self.close()

    def ready(self, item: Any) -> None:
        if item is self.listener:
            self.accept()
        elif item == self.leader:
            self.leader_gone = True
        elif isinstance(item, int) and item in self.forks:
            self.reap(item)
        else:  # a waiting job's connection: it closed (killed), so its fork goes too
            self.gone.add(item)  # watched no more: the fork's pidfd says when it is gone
            for pid, _, conn in self.forks.values():
                if conn is item:
                    _kill(pid)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        pid = 0
        try:
            request, fds = _read_request(conn)
            pid = self.fork(request, fds, conn)
            if pid:
                self.forks[os.pidfd_open(pid)] = (pid, request["snakemake"].rule, conn)  # tracked at once
            conn.sendall(_WORD.pack(pid))
        except Exception:  # a request it cannot read (the job then runs itself) or a job gone meanwhile
            if pid:
                _kill(pid)  # its job's process went before it knew: the fork goes too
                if pid not in (p for p, _, _ in self.forks.values()):
                    os.waitpid(pid, 0)  # untracked (no pidfd): reaped here
                    pid = 0
        finally:
            for fd in fds:
                os.close(fd)
        if not pid:
            conn.close()
            self.idle_since = time.monotonic()

    def fork(self, request: dict[str, Any], fds: list[int], conn: socket.socket) -> int:
        """Load what the rule's jobs imported before (each module once per runner), then fork: the fork's
        pid, or 0 where the job runs itself. Not while a Python thread runs here, which a fork could inherit
        mid-lock (the native threads pyarrow's jemalloc and torch start at import are restarted or idle
        across a fork, as in any forked data loader). The environment needs no check: it names the runner."""
        names = [request["target"].partition(":")[0], *sorted(self.learned.get(request["snakemake"].rule, ()))]
        for name in names:
            if name not in sys.modules:
                with contextlib.suppress(BaseException):  # one that imports only in its job's context stays cold
                    importlib.import_module(name)
        if threading.active_count() > 1:
            rule = request["snakemake"].rule
            print(f"dflash-build: warm runner: a job of {rule} runs apart: a Python thread runs here", file=sys.stderr)
            return 0
        sys.stdout.flush()  # nothing an import printed here reaches a job's stdout
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            conn.close()
            self.child(request, fds)
        return pid

    def child(self, request: dict[str, Any], fds: list[int]) -> None:
        """In the fork: become the job's process, do the job, exit as its process would; never return into
        the runner's loop, whatever fails."""
        try:
            self.listener.close()
            for pidfd, (_, _, conn) in self.forks.items():
                os.close(pidfd)
                conn.close()
            if self.leader is not None:
                os.close(self.leader)
            become(request, fds)
            before = set(sys.modules)
            status = job_status(request["target"], request["snakemake"])
            with contextlib.suppress(OSError):  # what it imported, for the runner to load for the rule's next job
                report = "\n".join(sorted(set(sys.modules) - before))
                Path(f"{self.address}.{os.getpid()}.modules").write_text(report)
            finish(status)
        except BaseException:  # the set-up failed: the job's process exits 1, as a job that failed
            traceback.print_exc()
        finally:
            os._exit(1)

    def reap(self, pidfd: int) -> None:
        pid, rule, conn = self.forks.pop(pidfd)
        self.gone.discard(conn)
        os.close(pidfd)
        _, wait_status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):  # else the job's process is gone: its fork was killed for it
            conn.sendall(_WORD.pack(os.waitstatus_to_exitcode(wait_status)))
        conn.close()
        report = Path(f"{self.address}.{pid}.modules")
        with contextlib.suppress(OSError):
            names = report.read_text().split()
            report.unlink()
            self.learned.setdefault(rule, set()).update(n for n in names if n.split(".")[0] not in _NOT_LOADED)
        self.idle_since = time.monotonic()

    def close(self) -> None:
        """Stop listening, and remove the socket unless a new runner already took its name."""
        self.listener.close()
        with open(f"{self.address}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with contextlib.suppress(OSError):
                if self.address.stat().st_ino == self.inode:
                    for path in (self.address, Path(f"{self.address}.log")):  # the lock stays: others may wait on it
                        path.unlink(missing_ok=True)


def _snakemake_leader() -> int | None:
    """A pidfd of this session's leader where that is a Snakemake (a build started in a session of its own:
    ``setsid``, a test's build): the runner ends with it, leaving nothing in the session once the build
    ends. None where the session is a terminal's or a test runner's, which the runner outlives by up to
    ``IDLE_SECONDS`` so the next build there starts warm."""
    leader = os.getsid(0)
    try:
        if b"snakemake" in Path(f"/proc/{leader}/cmdline").read_bytes():
            return os.pidfd_open(leader)
    except OSError:
        pass
    return None


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def become(request: dict[str, Any], fds: list[int]) -> None:
    """Take the job's stdio, working directory, import path and argv; the signal handlers of a new Python."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    for sig in request["ignored"]:  # what the job's process ignored when it started (nohup: SIGHUP)
        signal.signal(sig, signal.SIG_IGN)
    os.umask(request["umask"])
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=os.isatty(1))
    os.setpgid(0, request["group"])  # the job's process group: its group's signals are the fork's
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    sys.argv[:] = request["argv"]


def job_status(target: str, smk: Any) -> int:
    """Do the job; its exit code as Python's own exit would give it (a traceback printed first)."""
    try:
        call(target, smk)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return (e.code or 0) & 0xFF  # as the interpreter exits: sys.exit(-1) is status 255
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:  # what an uncaught exception does to a script
        traceback.print_exc()
        return 1
    return 0


def finish(status: int) -> None:
    """Exit the fork as an interpreter exits: join its threads, run its atexit functions, flush."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if status < 0:
        _die_by(-status)
    os._exit(status & 0xFF)
