"""Model parallelism beside the data-parallel engine: Lee et al.'s model-parallel FC layers
(:mod:`lowcomm.parallel.fc`, wired into ``lee18`` by :mod:`lowcomm.parallel.lee18_fc`)."""
