"""Moved to ``hotloop.queue.message_queue``; this name stays importable (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hotloop.queue.message_queue")
