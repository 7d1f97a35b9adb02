rule generate:
    input:
        prompts=get_prompt_manifest,
    output:
        data=update(f"{STORE}/completions/{{source}}/{{key}}/{{shard}}.parquet"),
        stats=update(f"{STORE}/completions/{{source}}/{{key}}/{{shard}}.stats.json"),
    log:
        f"{LOGS}/completions/{{source}}/{{key}}/{{shard}}.log",
    conda:
        GENERATE_ENV
    threads: get_generate_threads()
    resources:
        gpu=GENERATE_GPU,
        gpu_jobs=GENERATE_GPU_JOBS,
    script:
        "scripts/generate.py"
