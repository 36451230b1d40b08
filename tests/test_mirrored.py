"""hotloop.vllm.mirrored: the digest of a function's syntax tree is the same under every Python the package supports
(ast.dump's own output is not: 3.12 adds type_params, 3.13 leaves out empty fields), unchanged by formatting and
comments, and changed by any change to what the function does."""

import ast
import textwrap

from hotloop.vllm.mirrored import body_digest, tree_digest

SOURCE = '''
def process(self, paths: list[str], coord=None, *, flag=True, **kw):
    """A docstring."""
    with open(paths[0]) as f, lock:
        for i, (a, b) in enumerate(zip(paths, paths[1:])):
            if a == b"READY" and not (i % 2 or f"{a!r:>4}"):  # a comment
                continue
            try:
                x = {k: v for k, v in kw.items() if v} | {"y": [*paths, 1.5, -2, None]}
            except (KeyError, ValueError) as e:
                raise RuntimeError(e) from None
            else:
                yield lambda z=x: z[a:b:2]
    return await_(self.q.put_nowait((a, b)))
'''

GOLDEN = "5541d2418a684f28"  # the digest of SOURCE's function, under Python 3.10, 3.11, 3.12 and 3.13


def _fn(src):
    return ast.parse(textwrap.dedent(src)).body[0]


def test_the_digest_of_a_known_body_is_the_same_under_every_python():
    assert tree_digest(_fn(SOURCE)) == GOLDEN


def test_formatting_and_comments_leave_it_and_a_change_in_behaviour_moves_it():
    reformatted = SOURCE.replace("# a comment", "").replace("(i % 2 or", "(\n                i % 2 or")
    assert tree_digest(_fn(reformatted)) == GOLDEN
    assert tree_digest(_fn(SOURCE.replace("[1:]", "[2:]"))) != GOLDEN
    assert tree_digest(_fn(SOURCE.replace("put_nowait", "put"))) != GOLDEN


def test_a_function_object_digests_as_its_source():
    def sample(a, b=2):
        return a + b

    assert body_digest(sample) == tree_digest(_fn("def sample(a, b=2):\n    return a + b\n"))
    assert body_digest(len) is None  # no Python source
