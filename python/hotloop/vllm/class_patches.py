"""ClassPatches: attributes of vLLM's classes (or of modules) replaced in this process, and put back.

Contract: ``set(owner, attr, new)`` (owner: a class or a module) remembers what ``owner`` itself held under
``attr`` (or that it held nothing: an inherited or absent attribute) and sets ``new``; ``restore()`` puts every
remembered attribute back (deleting the ones that were not there) and forgets them; ``bool(patches)`` says whether
any is set. Not thread-safe: the plugin installs and uninstalls from one thread, before vLLM's threads use the
classes.
"""

from __future__ import annotations

import contextlib


class ClassPatches:
    _ABSENT = object()

    def __init__(self):
        self._saved: dict[tuple[type, str], object] = {}

    def set(self, owner: type, attr: str, new) -> None:
        self._saved.setdefault((owner, attr), owner.__dict__.get(attr, self._ABSENT))
        setattr(owner, attr, new)

    def restore(self) -> None:
        for (owner, attr), old in self._saved.items():
            if old is self._ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self._saved.clear()

    def owners(self) -> list[str]:
        return sorted({owner.__name__ for owner, _ in self._saved})

    def __bool__(self) -> bool:
        return bool(self._saved)


__all__ = ["ClassPatches"]
