# mix.generate: as_needed. The pilot round generates each source's first shard; its checkpoint sizes the
# first round (how far down each source's shards to generate for its category's target), the second
# checkpoint measures that round and tops up a category it left short, and the mix takes the shards the
# second names. `snakemake -n` shows the pilot until it exists, then the rounds it decides.


checkpoint size_pilot:
    input:
        tokens=planned_paths("size", "tokens", round_=1),
    output:
        sizing=SIZING[1],
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-size-1"),
    conda:
        "../envs/cpu.yaml"
    params:
        size=get_params("size"),
    script:
        "scripts/stage.py"


checkpoint size_topup:
    input:
        tokens=planned_input("size", "tokens", sizing="size_pilot", round_=2),
    output:
        sizing=SIZING[2],
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-size-2"),
    conda:
        "../envs/cpu.yaml"
    params:
        size=get_params("size"),
    script:
        "scripts/stage.py"
