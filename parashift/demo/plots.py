"""The demo's pictures: :mod:`parashift.plots` (the public module) under its old name."""
from ..plots import *  # noqa: F401,F403
from ..plots import __all__  # noqa: F401
