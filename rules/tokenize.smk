rule tokenize:
    input:
        get_completion_shard,
    output:
        data=update(f"{STORE}/tokens/{{source}}/{{key}}/{{shard}}.parquet"),
        stats=update(f"{STORE}/tokens/{{source}}/{{key}}/{{shard}}.stats.json"),
    log:
        f"{LOGS}/tokens/{{source}}/{{key}}/{{shard}}.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "scripts/tokenize.py"
