"""Scheduling on Ray, the only place Ray is imported: starting or joining Ray (``ray_session``), the
embedded Ray's leftovers (``embedded_ray``), one Tune run for every cell (``tune_run``), the searcher
over every cell (``searcher``) and a resume's reconciliation of it with the folder (``reconcile``,
Ray-free), the trainables and callbacks (``tune_adapters``), and the two Tuner shapes (``tuners``).
"""
