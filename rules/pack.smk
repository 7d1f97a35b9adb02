rule pack:
    input:
        rules.mix.output,
    output:
        directory(PACKED_RECORD),
    log:
        f"{LOGS}/dist/{CONFIG.dataset_name}-packed.log",
    conda:
        "../envs/cpu.yaml"
    params:
        pack=get_pack_params(),
    script:
        "scripts/pack.py"
