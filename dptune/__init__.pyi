from dptune.audit import _Auditor
from dptune.errors import DptuneError as DptuneError
from dptune.model import Model as Model
from dptune.model import load_model as load_model
from dptune.plan import _Planner
from dptune.plan.table import PlanRow as PlanRow
from dptune.search.api import Report as Report
from dptune.search.api import SearchPrivacy as SearchPrivacy
from dptune.search.api import SearchResult as SearchResult
from dptune.search.api import tune as tune
from dptune.space import SearchSpace as SearchSpace
from dptune.space import load_space as load_space

__version__: str
__all__: list[str]
plan: _Planner
audit: _Auditor
