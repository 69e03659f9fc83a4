"""Planning a search's cells (Ray-free): the cells and σ per B (``cells``), one sampler per cell
(``sampler``), tuning on a secret subsample (``subsample``).
"""
