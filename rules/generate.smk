rule generate:
    input:
        # the job's prompt shard lies beside its source's manifest (see rules/prepare.smk); what it reads to
        # skip the prompts a source ranked above it keeps: ancient(), their content is in the gen key
        prompts=planned_input("generate", "prompts", ancient),
        copies_of=planned_input("generate", "copies_of", ancient),
        # every source prepared (rules/prepared.smk): waited for, never a reason to regenerate
        prepared=planned_input(
            "generate", "prepared", dflash_build.snakemake_fixes.order_only
        ),
    output:
        data=update(shard_pattern(STORE, layout.COMPLETIONS, layout.DATA)),
        stats=update(shard_pattern(STORE, layout.COMPLETIONS, layout.SIDECAR)),
    log:
        shard_pattern(LOGS, layout.COMPLETIONS, layout.LOG),
    conda:
        GENERATE_ENV
    threads: get_generate_threads()
    resources:
        gpu=GENERATE_GPU,
        gpu_jobs=GENERATE_GPU_JOBS,
    script:
        "scripts/stage.py"
