"""`dflash-build` (or `python -m dflash_build`): steer a build from the command line.

plan      per source: prompt rows, shards built / to build, rows really generated after reuse,
          estimated output tokens and GPU-hours
explain   every key component of a target; for a missing one, what differs from the nearest
          key in the store
gc        store entries no config registered on the store references, and temporaries of dead
          writers (delete with --yes)
configs   the configs registered on the store (each build registers its own); --forget ID
verify    re-read every referenced store and dist file against its manifest, every journal, the
          row index and the fingerprint cache (--repair removes the bad files, so the next build
          rebuilds exactly those, and heals the derived state)
reindex   rebuild the per-row reuse index from the store
engines   the running shared engines (engine.shared): GPU, URL, identity, uptime, log; --stop
          stops those no job is using
status    where the build stands, from the store alone (also while Snakemake runs): rows done / to
          do per source, rows/s and output tok/s over the last minutes, ETA, failed and skipped
          rows, the jobs running and how long since their last row, the engines; --watch, --json
summary   the dataset summary of a built dist folder
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from dflash_build import config as config_mod
from dflash_build import plan as plan_mod
from dflash_build.engines import host as engine_host
from dflash_build.ops import estimate, explain, gc, registrations, status, verify
from dflash_build.publish import card, release
from dflash_build.spec import ConfigError
from dflash_build.store import filesystem, layout, rowindex


def _plan(args: argparse.Namespace) -> plan_mod.Plan:
    return plan_mod.build(config_mod.load(args.configfile))


def cmd_plan(args: argparse.Namespace) -> int:
    plan = _plan(args)
    estimates, disk, mix_forecast = estimate.estimate_with_disk(plan, args.tokens_per_second)
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in estimates], indent=2))
        return _errors(estimates, disk)
    header = (
        f"{'source':<28}{'prompts':>10}{'shards':>8}{'built':>7}{'todo':>6}{'rows':>9}{'reused':>8}{'generate':>10}"
    )
    print(header + f"{'out tokens':>13}{'GPU-h':>9}")
    for e in estimates:
        rows = f"{e.prompt_rows}" if e.prompt_rows_known else f"≤{e.prompt_rows}"
        print(
            f"{e.source:<28}{rows:>10}{e.shards:>8}{e.completions_built:>7}{len(e.generate_jobs):>6}"
            f"{e.rows_in_jobs:>9}{e.rows_reused + e.rows_journaled:>8}{e.rows_to_generate:>10}"
            f"{e.output_tokens:>13.0f}{e.gpu_hours:>9.2f}"
        )
    total = sum(e.rows_to_generate for e in estimates)
    tokens = sum(e.output_tokens for e in estimates)
    hours = sum(e.gpu_hours for e in estimates)
    jobs = sum(len(e.generate_jobs) for e in estimates)
    print(f"total: {jobs} generate jobs, {total} rows to generate, {tokens:.0f} output tokens, {hours:.2f} GPU-hours")
    shared = [e for e in estimates if e.cross_source_prompts]
    if shared:
        each = ", ".join(f"{e.source} {e.cross_source_prompts}" for e in shared)
        print(
            f"across sources: {sum(e.cross_source_prompts for e in shared)} prompts another source holds too "
            f"({each}); the mix takes each once, and generating them twice would cost "
            f"{sum(e.cross_source_gpu_hours for e in shared):.2f} GPU-hours (the row index serves the later "
            "source's rows when the sampling agrees)"
        )
    print("\n".join(mix_forecast.lines()))
    window = plan.config.trainer.max_length if total else None
    if window is not None:
        print(_window_line(window, estimates, hours / tokens if tokens else 0.0))
    print(disk.line())
    for line in release.pending(plan.config.dist_folders):
        print(line)
    if args.jobs:
        for e in estimates:
            for job in e.generate_jobs:
                print(f"generate {job}")
    return _errors(estimates, disk)


def _window_line(window: int, estimates: list[estimate.SourceEstimate], hours_per_token: float) -> str:
    """What trainer.max_length saves on the rows to generate, with and without it."""
    effects = [e.window for e in estimates if e.window is not None]
    if not effects:
        return (
            f"trainer.max_length {window}: no answer of this model in the store to estimate its effect from "
            "(bench/trainer_window.py models it)"
        )
    sample = effects[0].sample_rows  # one sample of this model's answers serves every source
    with_window = sum(w.output_tokens for w in effects)
    without = sum(w.output_tokens_without for w in effects)
    past = sum(w.past_window_tokens for w in effects)
    dropped = sum(w.dropped_rows for w in effects)
    skipped = sum(w.skipped_rows for w in effects)
    return (
        f"trainer.max_length {window} (estimated from {sample} answers of this model in the store): "
        f"{with_window:.0f} output tokens, {with_window * hours_per_token:.2f} GPU-hours, {skipped:.0f} prompts "
        f"skipped; without it {without:.0f} tokens, {without * hours_per_token:.2f} GPU-hours, of which "
        f"{past:.0f} tokens past the window (the trainer cuts them) and {dropped:.0f} rows dropped at "
        "max_new_tokens (truncated: drop)"
    )


def _errors(estimates: list[estimate.SourceEstimate], disk: estimate.DiskNeed) -> int:
    """Print what would fail the build (exit 1), and what may (warnings), before any GPU work is spent on it."""
    warnings, disk_errors = disk.problems()
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    errors = [error for e in estimates for error in e.errors] + disk_errors
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


def cmd_explain(args: argparse.Namespace) -> int:
    plan = _plan(args)
    if len(args.target) == 1:
        stage, source, shard = explain.parse_target(plan, args.target[0])
    else:
        stage, (source, shard) = args.stage, args.target
    print("\n".join(explain.explain(plan, stage, source, shard)))
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    # registers nothing: only a build says what a config uses (an edited config may never be built)
    plan = _plan(args)
    entries = gc.garbage(plan, args.journals, args.tmp_age * 60, args.break_datasets)
    for e in entries:
        action = "keep" if e.kept else ("delete" if args.yes else e.why)
        why = f": {e.why}" if e.why.startswith(("used by", "breaks", "dataset")) else ""
        hint = "; --break-datasets deletes it" if e.kept and e.why.startswith("used by") else ""
        print(f"{action} {e.path} ({e.bytes} bytes){why}{hint}")
    kept_for_others = gc.protected(plan)
    if kept_for_others:
        configs = sorted({who for whos in kept_for_others.values() for who in whos})
        print(
            f"kept: {len(kept_for_others)} entries other registered configs reference "
            f"({'; '.join(configs)}); `dflash-build configs` lists them"
        )
    if not entries:
        print("nothing unreferenced")
    elif args.yes:
        print(f"freed {gc.collect(plan, entries)} bytes")
    else:
        print("dry run: pass --yes to delete (journals of unfinished shards only with --journals)")
    return 0


def cmd_configs(args: argparse.Namespace) -> int:
    store = config_mod.load(args.configfile).store
    if args.forget:
        print(f"forgot {registrations.forget(store, args.forget)}")
        return 0
    for ident, entry in registrations.registrations(store).items():
        print(
            f"{ident}  {entry['dataset']}  (workdir {entry.get('workdir')}, host {entry.get('host')}, "
            f"last build {entry.get('updated_at')}, {len(entry['references'])} store entries)"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    # the cache is checked before a plan is built: building one heals it
    problems = verify.cache_problems(config_mod.load(args.configfile))
    plan = _plan(args)
    checked, found = verify.verify(plan)
    problems += found
    for p in problems:
        print(f"{'CANNOT READ' if p.unreadable else 'BAD'} {p.path}: {p.reason}")
    for line in release.pending(plan.config.dist_folders):
        print(line)
    unreadable = sum(p.unreadable for p in problems)
    cannot = f", {unreadable} not readable by this user (--repair leaves them)" if unreadable else ""
    print(f"checked {checked + 1} files, {len(problems) - unreadable} bad{cannot}")
    if problems and args.repair:
        for path in verify.repair(plan, problems):
            print(f"repaired {path}")
        print("the next build regenerates exactly what was removed")
        return 0
    return 1 if problems else 0


def cmd_reindex(args: argparse.Namespace) -> int:
    plan = _plan(args)
    print(f"indexed {rowindex.rebuild(plan.config.store)} completion shards")
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    folder = Path(args.dataset)
    print(card.summary(json.loads((folder / layout.MANIFEST).read_text()), folder))
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.configfile)
    lock_dir = cfg.engine.lock_dir
    print(engine_host.describe(engine_host.running(lock_dir)))
    if args.stop:
        stopped = engine_host.stop_idle(lock_dir)
        busy = [s["slot"] for s in engine_host.running(lock_dir)]
        left = f"; in use, left running: {', '.join(busy)}" if busy else ""
        print(f"stopped: {', '.join(stopped) or 'none'}{left}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    plan = _plan(args)
    if args.watch is None:
        now = status.collect(plan, args.window)
        print(json.dumps(now.as_dict(), indent=2) if args.json else status.text(now))
        return 0
    return status.watch(plan, args.watch, args.window, as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        # the reader went away (`status | head`): nothing more to say, and Python's flush at exit must
        # not complain about the closed pipe either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except filesystem.StoreFault as e:
        print(f"dflash-build {args.command}: {e}", file=sys.stderr)
        return 2
    except (ConfigError, KeyError, ValueError, FileNotFoundError) as e:
        print(f"dflash-build {args.command}: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The command line: the store commands (plan, explain, gc, ...) and the build views (status, summary)."""
    parser = argparse.ArgumentParser(
        prog="dflash-build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configfile", default="config/config.yaml", help="config file (default: %(default)s)")
    # ... and after the subcommand too, where Snakemake users type it (`verify --configfile X`)
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--configfile", default=argparse.SUPPRESS, help="config file")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", parents=[after], help="what a build would do and cost")
    p.add_argument("--jobs", action="store_true", help="also list every generate job")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--tokens-per-second",
        type=float,
        default=estimate.DEFAULT_TOKENS_PER_SECOND,
        help="output tok/s per GPU when the store has no measured shard (default: %(default)s)",
    )
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("explain", parents=[after], help="why a target would (re)build")
    p.add_argument("target", nargs="+", help="a store path, or SOURCE SHARD")
    p.add_argument("--stage", choices=sorted(layout.STAGES), default="completions", help="with SOURCE SHARD")
    p.set_defaults(func=cmd_explain)
    p = sub.add_parser("gc", parents=[after], help="unreferenced store entries")
    p.add_argument("--yes", action="store_true", help="delete them")
    p.add_argument("--journals", action="store_true", help="also delete journals of unfinished shards")
    p.add_argument(
        "--break-datasets",
        action="store_true",
        help="also delete entries a built dataset folder was made from (each is named with the folder it breaks)",
    )
    p.add_argument(
        "--tmp-age",
        type=float,
        default=gc.TMP_AGE_SECONDS / 60,
        help="minutes a temporary must be untouched to count as stray (default: %(default)s)",
    )
    p.set_defaults(func=cmd_gc)
    _view_commands(sub, after)
    return parser


def _view_commands(sub: Any, after: argparse.ArgumentParser) -> None:
    p = sub.add_parser("configs", parents=[after], help="configs registered on the store")
    p.add_argument("--forget", metavar="ID", help="drop a retired config's registration")
    p.set_defaults(func=cmd_configs)
    p = sub.add_parser("verify", parents=[after], help="check every referenced file against its manifest")
    p.add_argument("--repair", action="store_true", help="remove bad files so the next build rebuilds them")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("reindex", parents=[after], help="rebuild the row reuse index")
    p.set_defaults(func=cmd_reindex)
    p = sub.add_parser("engines", parents=[after], help="the running shared engines (engine.shared)")
    p.add_argument("--stop", action="store_true", help="stop those no job is using")
    p.set_defaults(func=cmd_engines)
    p = sub.add_parser("status", parents=[after], help="where the build stands (reads only; any terminal)")
    p.add_argument("--json", action="store_true", help="machine-readable output (one object a line with --watch)")
    p.add_argument(
        "--watch", type=float, nargs="?", const=5.0, metavar="SECONDS", help="refresh every SECONDS (default 5)"
    )
    p.add_argument(
        "--window",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="rates over the last SECONDS (default: %(default)s)",
    )
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("summary", parents=[after], help="summary of a built dataset")
    p.add_argument("dataset", help="dist/NAME")
    p.set_defaults(func=cmd_summary)


if __name__ == "__main__":
    sys.exit(main())
