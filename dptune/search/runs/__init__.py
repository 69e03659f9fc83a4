"""Running and recording, Ray-free: a unit's runs (:class:`~dptune.search.runs.execution.RunSpec`)
charged in the privacy ledger at their mechanism, trained once and recorded (``execution``), and a
private unit's share of its cell's proposals (``private_units``). Imports the runners and records,
never the planner, Ray or the finished search.
"""
