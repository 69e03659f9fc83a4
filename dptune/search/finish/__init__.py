"""A finished search (Ray-free): its rows and summary (``outcome``), what its (ε, δ) covers
(``statement``), published models (``publish``), MLflow (``tracking``; runs logged as they finish,
``live_tracking``; models as MLflow pyfunc models, ``mlflow_model``).
"""
