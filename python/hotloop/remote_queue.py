"""Moved to ``hotloop.queue.remote``; this name stays importable (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hotloop.queue.remote")
