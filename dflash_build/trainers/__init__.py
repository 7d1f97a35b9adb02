"""Trainer backends: what trains a drafter on the dataset (the `train` stage), one module per trainer behind
one descriptor (:mod:`.base`), found by :mod:`.registry`."""
