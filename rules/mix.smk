rule mix:
    input:
        get_token_shards(),
    output:
        directory(DATASET_DIR),
    log:
        f"{LOGS}/dist/{CONFIG.dataset_name}.log",
    conda:
        "../envs/cpu.yaml"
    params:
        mix=get_mix_params(),
    script:
        "scripts/mix.py"
