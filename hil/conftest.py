"""pytest configuration of the hardware-in-the-loop rig: everything lives in hil/plugin.py (so
`python -m pytest -p hil.plugin` can load the same rig elsewhere)."""
from hil.plugin import *  # noqa: F401,F403  (hooks, options and fixtures)
