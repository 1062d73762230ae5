"""The workbench's views: each draws one part of a :class:`workbench.compute.Result`.

Every view builds its widgets and marks once and updates them in place (inside
``hold_sync()``); none reaches into a kernel.
"""

from workbench.views.difference import DifferenceView
from workbench.views.download import Download
from workbench.views.profile import ProfileView
from workbench.views.relax import RelaxView
from workbench.views.resolution import ResolutionView
from workbench.views.slice import SliceView
from workbench.views.status import StatusView
from workbench.views.table import AtomTableView
from workbench.views.timing import TimingView
from workbench.views.view3d import Scene3DView, View3D

__all__ = [
    "AtomTableView",
    "DifferenceView",
    "Download",
    "ProfileView",
    "RelaxView",
    "ResolutionView",
    "Scene3DView",
    "SliceView",
    "StatusView",
    "TimingView",
    "View3D",
]
