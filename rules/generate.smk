rule generate:
    input:
        get_prompt_shard,
    output:
        data=update(f"{STORE}/completions/{{source}}/{{key}}/{{shard}}.parquet"),
        stats=update(f"{STORE}/completions/{{source}}/{{key}}/{{shard}}.stats.json"),
    log:
        f"{LOGS}/completions/{{source}}/{{key}}/{{shard}}.log",
    conda:
        GENERATE_ENV
    threads: get_generate_threads()
    resources:
        gpu=get_generate_gpu,
        gpu_jobs=get_generate_gpu_jobs,
    params:
        components=get_gen_components,
    script:
        "scripts/generate.py"
