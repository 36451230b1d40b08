"""QueueSlot: an engine core's ``queue.Queue`` attribute, swapped for hotloop's queue on its first read.

Contract: vLLM's ``EngineCoreProc.__init__`` assigns its ``input_queue`` and ``output_queue`` (plain
``queue.Queue``) before the plugin loads (``EngineCore.__init__`` loads plugins), so the plugin cannot hand it
another queue up front. ``QueueSlot(name, make)``, set on the class as the attribute ``name``, converts the
instance's queue on its first read after that: under a lock, a queue made by ``make()`` takes its place with the
old one's items in order (put with the new queue's ``put``). Every reader gets the queue through this read (vLLM
writes ``self.input_queue.put_nowait(...)``, never a saved reference), so none holds the old one afterwards. A
queue that is not exactly ``queue.Queue`` (the new one, or one a caller assigned) is returned as it is.
"""

from __future__ import annotations

import queue
import threading


class QueueSlot:
    def __init__(self, name: str, make):
        self.name = name
        self.make = make
        self._lock = threading.Lock()

    def __get__(self, core, owner=None):
        if core is None:
            return self
        try:
            q = core.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
        return q if type(q) is not queue.Queue else self._convert(core)

    def __set__(self, core, value):
        core.__dict__[self.name] = value

    def _convert(self, core):
        with self._lock:
            q = core.__dict__[self.name]
            if type(q) is queue.Queue:
                new = self.make()
                with q.mutex:
                    for item in q.queue:
                        new.put(item)
                    q.queue.clear()
                core.__dict__[self.name] = q = new
        return q


__all__ = ["QueueSlot"]
