# `dflash-build preflight`: the engine's environment, the model folder, every engine started as the build
# starts them and a pilot of each source through the real driver, before the build (config key `preflight`,
# dflash_build.stages.preflight). Not part of `all`. The pilot's rows are journaled for the build.
rule preflight:
    input:
        prepared=planned_paths("preflight", "prepared"),
    output:
        summary=planned_paths("preflight", "summary", True)[0],
    log:
        layout.preflight_log(LOGS, CONFIG.dataset_name),
    conda:
        GENERATE_ENV
    resources:
        gpu=1 if dflash_build.engines.uses_gpu(CONFIG.engine) else 0,
    script:
        "scripts/stage.py"
