"""dptune: hyperparameter search for differentially private deep transfer learning.

Data flows one way: search space → plan (accounting, pruning) → trials → result records →
analysis and reports. See README.md for the map of modules.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dptune")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
