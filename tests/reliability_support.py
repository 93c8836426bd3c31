"""The old path of tests/support/reliability_support.py, kept for bench/ (bench/forkserver_loss.py
and load.py import `tests.reliability_support`): this name is the support module itself. Remove
once bench/ names tests/support/."""

import sys

from tests.support import reliability_support as _support

sys.modules[__name__] = _support
