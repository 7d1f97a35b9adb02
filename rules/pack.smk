rule pack:
    input:
        dataset=rules.mix.output,
    output:
        record=directory(planned_paths("pack", "record", True)[0]),
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-packed"),
    conda:
        "../envs/cpu.yaml"
    params:
        pack=get_params("pack"),
    script:
        "scripts/stage.py"
