rule pack:
    input:
        dataset=rules.mix.output,
    output:
        record=directory(PACKED_RECORD),
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-packed"),
    conda:
        "../envs/cpu.yaml"
    params:
        pack=get_pack_params(),
    script:
        "scripts/pack.py"
