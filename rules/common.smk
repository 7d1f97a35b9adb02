import os
import sys
from pathlib import Path

import dflash_build.config
import dflash_build.configfile
import dflash_build.engines.host
import dflash_build.engines
import dflash_build.engines.registry
import dflash_build.plan
import dflash_build.stages.prepare.checks
import dflash_build.stages.common.job
import dflash_build.stages.registry
import dflash_build.publish.release
import dflash_build.snakemake_fixes
import dflash_build.versions
import dflash_build.workflow
from dflash_build.store import layout
from dflash_build.hashing import canonical_json
from dflash_build.store.layout import shard_pattern

# A key given twice in a config file, or one the schema does not know, stops the run in a line that
# names it and the closest valid key (Snakemake's validate quotes the whole schema); the schema's
# defaults are filled in place.
for config_file in workflow.config_settings.configfiles or workflow.configfiles:
    dflash_build.workflow.parsed(dflash_build.configfile.read_file, config_file)
dflash_build.workflow.parsed(dflash_build.configfile.validate, config)


dflash_build.workflow.warnings_to_stderr()
dflash_build.snakemake_fixes.apply()
CONFIG = dflash_build.workflow.parsed(dflash_build.config.from_dict, config)
PLAN = dflash_build.workflow.parsed(dflash_build.plan.build, CONFIG)

STORE = str(CONFIG.store)
LOGS = str(CONFIG.logs)
dflash_build.workflow.warn_if_recorded_but_missing(CONFIG)
# A dry run starts nothing and writes nothing but the store's file-digest cache (derived; see
# dflash_build.workflow.is_dry_run).
DRY_RUN = dflash_build.workflow.is_dry_run(sys.argv)
# The engine a build would start on this machine (its device, its interpreter), named with the setting
# to use (a dry run, like `plan`, on a login node, starts none).
if not DRY_RUN:
    dflash_build.workflow.parsed(
        dflash_build.engines.registry.check_environment, CONFIG.engine
    )
# A killed run's locks stop the next plain run: they go when no other run of this workflow is alive.
if not DRY_RUN:
    dflash_build.workflow.release_stale_locks(Path(os.getcwd()))
# A build needs a store it can write, with checks.min_free_gb free: one line, before any job starts.
if not DRY_RUN:
    dflash_build.workflow.or_exit(dflash_build.workflow.check_store, CONFIG)
# In the batch step of a SLURM allocation that generates: the broker that keeps its engines (engine_host).
if not DRY_RUN:
    dflash_build.engines.host.start_allocation_broker(CONFIG, sys.argv)
# A job on its own engine asks for gpu=1. With shared engines it asks for gpu_jobs=1 instead, and
# gpu_jobs = --resources gpu x engine.jobs_per_engine, so two jobs feed each GPU's engine. Submitted to a
# cluster, each job asks for its GPU instead: the cluster profiles set gpu=1, gpu_jobs=0 for generate
# (profiles/slurm). Plain values, not functions: Snakemake inspects a function's signature for every
# job, which at 100,000 shards costs more than the rest of planning.
GENERATE_GPU, GENERATE_GPU_JOBS, GPU_JOBS = dflash_build.workflow.generate_resources(
    CONFIG.engine, workflow.global_resources.get("gpu")
)
if GPU_JOBS is not None:
    workflow.register_resource("gpu_jobs", GPU_JOBS)
# A source whose first rows are all defects (a wrong format or fields) stops the run here, before any
# job takes a GPU; its prepare job would find it only after the other sources' generation started.
for source_name in PLAN.sources:
    if not PLAN.prompt_manifest(source_name).exists():
        dflash_build.workflow.parsed(
            dflash_build.stages.prepare.checks.check_sample, PLAN, source_name
        )
# What each key is made of, kept in the store: a job whose own plan gives another key says what
# changed (workflow.check_key) without a params function per job.
if not DRY_RUN:
    dflash_build.workflow.or_exit(dflash_build.plan.record_components, PLAN)


GENERATE_ENV = (
    f"../envs/{dflash_build.engines.registry.get(CONFIG.backend).conda_env}.yaml"
)


wildcard_constraints:
    source=r"[A-Za-z0-9][A-Za-z0-9_.@-]*",  # PARENT@VARIANT: a source's sampling variant
    key=r"[0-9a-f]{16}",
    shard=r"\d{5}",
    fmt="|".join(CONFIG.exports) or "none",


# The stages this config enables (each declared by its package: dflash_build.stages.registry); the
# Snakefile includes their rule files, in the order the data flows.
STAGES = dflash_build.stages.registry.enabled(CONFIG)


def get_final_targets():
    # what each enabled stage adds to `snakemake` with no target: the dataset, packed, exports, the split
    return [str(p) for p in dflash_build.stages.registry.final_targets(PLAN)]


def get_params(stage):
    """A rule's params: its stage's (the descriptor's ``params``), as canonical JSON, so that reordering
    the config does not rerun it; a function of the wildcards for a stage with a job per format.
    """
    declared = dflash_build.stages.registry.get(stage)
    if declared.per == "format":
        return lambda wildcards: canonical_json(
            declared.params(PLAN, dflash_build.stages.registry.Of(fmt=wildcards.fmt))
        )
    return canonical_json(declared.params(PLAN, dflash_build.stages.registry.Of()))


def planned_input(stage, name, flag=None, sizing=None, **fixed):
    """The input function of a rule's input ``name``: what the planner declares for the job
    (dflash_build.stages.registry.planned, which tests/test_rules.py holds the rules to), each path
    with ``flag`` (ancient); ``sizing``: the name of the checkpoint whose sizing file names the shards
    (as_needed; by name: rules/size.smk is read after the rules that name it); ``fixed``: more of what
    the job is for (a size job's round).
    """

    def paths(wildcards):
        of = {
            k: wildcards[k] for k in ("source", "shard", "fmt") if k in wildcards.keys()
        }
        if sizing is not None:
            of["sizing"] = getattr(checkpoints, sizing).get().output.sizing
        job = dflash_build.stages.registry.planned(PLAN, stage, **of, **fixed)
        return [flag(str(p)) if flag else str(p) for p in job.inputs[name]]

    return paths


def planned_paths(stage, name, of_outputs=False, **of):
    """A rule's input (or output) ``name`` of a job the plan alone decides (a source's prepare, the mix)."""
    job = dflash_build.stages.registry.planned(PLAN, stage, **of)
    return [str(p) for p in (job.outputs if of_outputs else job.inputs)[name]]


# The prepare job compares its own key with the one asked for; these say what differs if they do not
# match. Canonical JSON: one string per key, so the params rerun trigger never fires for a reordered
# config. (Shard jobs read the same from the store: dflash_build.plan.record_components.)
def get_prompt_components(source):
    return canonical_json(PLAN.sources[source].prompt_components)


# mix.generate: as_needed (rules/size.smk): the pilot's shards, and each round's sizing.
AS_NEEDED = CONFIG.mix_generate == "as_needed"
SIZING = {
    n: layout.sizing_file(LOGS, CONFIG.dataset_name, n) for n in layout.SIZING_ROUNDS
}
# a dataset that stands over lost store shards: a dry run says so as plan, verify and status do
if DRY_RUN:
    import dflash_build.ops.standing

    if (lost := dflash_build.ops.standing.standing(PLAN)) is not None:
        print(f"dflash-build: {lost.line()}", file=sys.stderr)
# jobs behind a size checkpoint that reruns are not in a dry run's list: one line says which will run
if DRY_RUN and AS_NEEDED:
    import dflash_build.ops.estimate  # its imports cost a dry run only

    if (note := dflash_build.ops.estimate.dry_run_note(PLAN)) is not None:
        print(note, file=sys.stderr)


def get_generate_threads():
    backend = dflash_build.engines.registry.get(CONFIG.backend)
    return backend.threads(CONFIG.engine_options)


def register_config():
    # gc from any config sharing this store keeps what this one references
    import dflash_build.ops.estimate
    import dflash_build.ops.registrations

    dflash_build.workflow.or_exit(dflash_build.ops.registrations.register, PLAN)
    # Once per build, not per job: the row index learns the shards it lacks (see rowindex).
    dflash_build.workflow.or_exit(dflash_build.workflow.sync_index, CONFIG)
    # the remaining work against the store's free space: a warning (checks.min_free_gb refused above)
    dflash_build.ops.estimate.warn_at_start(PLAN)


def stop_engines():
    # Shared engines stop when the workflow ends (those another build still uses wait for their idle
    # timeout); a killed Snakemake leaves them to the idle timeout too.
    import dflash_build.engines.host

    dflash_build.engines.host.stop_workflow_engines(CONFIG)


def explain_failure():
    # a prepare that failed held back every generate job: say which, once, after Snakemake's own lines
    if (line := dflash_build.workflow.unprepared_line(PLAN)) is not None:
        print(line, file=sys.stderr)


def print_summary():
    # what each enabled stage says of what it built (the dataset's card summary, packed, exports)
    for declared in STAGES:
        for line in declared.summary(PLAN):
            print(line)
