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
            files=[ancient(str(f)) for f in source_plan.input_files],
            references=[ancient(str(f)) for f in get_reference_files()],
        output:
            manifest=update(str(PLAN.prompt_manifest(source_name))),
            bands=get_prompt_bands(source_name),
        log:
            layout.prepare_log(LOGS, source_name, source_plan.prompt_key),
        conda:
            "../envs/cpu.yaml"
        params:
            source=source_name,
            key=source_plan.prompt_key,
            components=get_prompt_components(source_name),
        script:
            "scripts/prepare.py"
