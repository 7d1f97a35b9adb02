rule mix:
    input:
        tokens=get_sized_token_shards if AS_NEEDED else get_token_shards(),
        bands=get_all_prompt_bands(),
        # the card's removed-rows table reads each source's prepare accounting
        manifests=[ancient(m) for m in PROMPT_MANIFESTS.values()],
    output:
        # the card's plots and tables go into `snakemake --report report.html` too
        record=report(
            directory(DATASET_RECORD),
            patterns=["plots/{name}.png", "tables/{name}.csv"],
            caption="report/dataset.rst",
            category="Dataset",
        ),
    log:
        layout.dist_log(LOGS, CONFIG.dataset_name),
    conda:
        "../envs/cpu.yaml"
    params:
        mix=get_mix_params(),
    script:
        "scripts/mix.py"
