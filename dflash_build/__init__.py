"""dflash-build: a declarative, content-addressed data build for speculative-decoding drafters.

Each stage is one module (``prepare``, ``generate``, ``tokenize``, ``mix``); engines live in
``dflash_build.engines`` behind one small interface; ``plan`` computes every content key and store
path when the Snakefile is parsed.
"""

__version__ = "0.1.0"
