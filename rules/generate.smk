rule generate:
    input:
        prompts=get_prompt_manifest,
        copies_of=get_copies_inputs,
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
        "scripts/generate.py"
