"""The name earlier versions used for :mod:`kakeyaturbo.calibration`; everything it held is
there, by job. Kept so that ``from kakeyaturbo import calibrate`` goes on working."""

from .calibration import *  # noqa: F401,F403
from .calibration import __all__  # noqa: F401
