rule pack:
    input:
        DATASET_DIR,
    output:
        directory(PACKED_DIR),
    log:
        f"{LOGS}/dist/{CONFIG.dataset_name}-packed.log",
    conda:
        "../envs/cpu.yaml"
    params:
        pack=get_pack_params(),
    script:
        "scripts/pack.py"
