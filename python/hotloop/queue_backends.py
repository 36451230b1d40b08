"""Moved to ``hotloop.queue.backends``; this name stays importable (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hotloop.queue.backends")
