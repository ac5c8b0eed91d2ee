"""Imported by the forkserver at its start (a preload): the forkserver dies with the launcher that
started it, and with it every worker (each asks to die with the forkserver)."""
from .jobstore import die_with_parent

die_with_parent()
