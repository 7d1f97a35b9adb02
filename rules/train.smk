# config key `train`: a drafter trained on the dataset by the trainer backend (dflash_build.stages.train),
# published to dist/NAME-drafter. Not part of `all`: `snakemake train`, or `snakemake accept` with a
# `trained` drafter. A dataset version trained on before takes its drafter from the store.
rule train:
    input:
        dataset=planned_paths("train", "dataset"),
    output:
        record=directory(planned_paths("train", "record", True)[0]),
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-drafter"),
    resources:
        gpu=CONFIG.train.gpus,
    params:
        train=get_params("train"),
    script:
        "scripts/stage.py"
