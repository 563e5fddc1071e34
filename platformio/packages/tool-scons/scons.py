# SCons entry point for PlatformIO (tool-scons), written by tinydeploy.firmware.pio.ensure_core().
# PlatformIO runs `python <this folder>/scons.py ...`; SCons itself is the one pip installed.
import sys

SCONS_PARENT = None  # the folder holding the SCons package, filled in by ensure_core()

if SCONS_PARENT and SCONS_PARENT not in sys.path:
    sys.path.insert(0, SCONS_PARENT)

from SCons.Script import main  # noqa: E402

if __name__ == "__main__":
    main()
