"""One module per engine backend, each defining ``BACKEND`` (see :mod:`dflash_build.engines.registry`).

These modules are light: an engine library is imported only inside their functions."""
