"""A finished search (Ray-free): its rows and summary (``outcome``), what its (ε, δ) covers
(``statement``), published models (``publish``), MLflow (``tracking``).
"""
