"""Moved to ``hotloop.queue.serialization``; this name stays importable (the same module object), and messages
name ``hotloop.serialization._rebuild_tensor`` through it."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hotloop.queue.serialization")
