"""Scheme versions of what each stage writes.

Bump one by hand when a code change changes the bytes a stage writes for the same inputs: every key
downstream changes and the affected shards rebuild. Code edits that do not change output leave these
alone and rerun nothing.
"""

PREP_VERSION = 1
GEN_VERSION = 1
TOK_VERSION = 1
MIX_VERSION = 1
