# One prepare rule per source: a source writes all of its prompt shards in one pass (dedup and
# max_samples look at every row). Its one declared output is the manifest, written last: generate jobs
# reach their prompt shard through it (with dedup.near, the band keys the mix compares are a second). Declaring every shard would make planning quadratic in shards
# (Snakemake scans a producer's outputs for every job that consumes one of them).
# Store outputs are update(): Snakemake must not delete them before a job runs, since another working
# directory sharing the store may be reading them; every store write replaces its file atomically.
for source_name, source_plan in PLAN.sources.items():

    rule:
        name:
            layout.prepare_rule_name(source_name)
        input:
            files=[
                ancient(p)
                for p in planned_paths("prepare", "files", source=source_name)
            ],
            # decontaminate's local reference files: their content is in every prompt key already
            references=[
                ancient(p)
                for p in planned_paths("prepare", "references", source=source_name)
            ],
        output:
            manifest=update(
                planned_paths("prepare", "manifest", True, source=source_name)[0]
            ),
            # with dedup.near: the band keys the mix compares across sources
            bands=[
                update(p)
                for p in planned_paths("prepare", "bands", True, source=source_name)
            ],
        log:
            layout.prepare_log(LOGS, source_name, source_plan.prompt_key),
        conda:
            "../envs/cpu.yaml"
        params:
            source=source_name,
            key=source_plan.prompt_key,
            components=get_prompt_components(source_name),
        script:
            "scripts/stage.py"
