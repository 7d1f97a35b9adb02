# dflash-build: the target model's own answers to a prompt mix, as a content-addressed build.
# Every store path carries the hash of what determines its content (docs/architecture.md);
# `snakemake -n` lists every shard job that would run.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/prepare.smk"
include: "rules/prepared.smk"
include: "rules/generate.smk"
include: "rules/tokenize.smk"
include: "rules/mix.smk"


if AS_NEEDED:

    include: "rules/size.smk"


if CONFIG.pack:

    include: "rules/pack.smk"


if CONFIG.exports:

    include: "rules/export.smk"


if CONFIG.held_out:

    include: "rules/evalset.smk"


if CONFIG.accept:

    include: "rules/accept.smk"


include: "rules/preflight.smk"


rule all:
    default_target: True
    input:
        get_final_targets(),


onstart:
    register_config()


onsuccess:
    stop_engines()
    print_summary()


onerror:
    stop_engines()
    explain_failure()
