"""Mode and role are parsed once (issue 28, item 2): the config (``triton_disagg/config``)
turns their text into :class:`~triton_disagg.config.roles.Mode` / ``Role``; every other
module compares members or asks a property (``config.aggregated``), never a string, so a
misspelt ``"agregated"`` cannot silently be false. Read from the source with ``ast``, as
test_layers.py reads imports.
"""

from __future__ import annotations

import ast

from test_layers import ROOT, _sources

PARSERS = ROOT / "triton_disagg" / "config"     # where the text is parsed
NAMES = {"mode", "role"}


def _named(node: ast.AST) -> str | None:
    """``mode`` of ``mode``, ``config.mode``, ``self.owner.mode``; else None."""
    name = node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else None
    return name if name in NAMES else None


def _text(node: ast.AST) -> bool:
    """A string literal, or a tuple/list/set of them (``role in ("all", "scheduler")``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(_text, node.elts))


def string_compares(source: str) -> list[int]:
    """Lines of ``source`` that compare a mode or role to string literals."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(_named, operands)) and any(map(_text, operands)):
                lines.append(node.lineno)
    return lines


def test_no_mode_or_role_is_compared_to_a_string_outside_the_config():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in _sources()
             if PARSERS not in path.parents
             for line in string_compares(path.read_text())]
    assert found == []


def test_the_scan_sees_each_way_of_comparing():
    probe = ("if config.mode == 'aggregated': pass\n"
             "x = args.role not in ('context', 'generation')\n"
             "y = 'scheduler' != self.owner.role\n"
             "z = mode == Mode.AGGREGATED or model == 'context' or role in ROLES\n")
    assert string_compares(probe) == [1, 2, 3]


# Private names of the standard library that the package calls on purpose.
STDLIB_PRIVATE = {"os._exit"}


def private_calls(source: str) -> list[str]:
    """``obj._name(...)`` calls in ``source`` whose ``obj`` is not ``self``, ``cls`` or
    ``super()`` (a subclass extending its own base): one class reaching into another's
    private method (issue 28, item 3)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr.startswith("_") and not node.func.attr.startswith("__")):
            owner = ast.unparse(node.func.value)
            if owner not in ("self", "cls", "super()") and f"{owner}.{node.func.attr}" not in STDLIB_PRIVATE:
                found.append(f"{node.lineno}: {owner}.{node.func.attr}")
    return found


def test_no_class_calls_another_ones_private_method():
    found = [f"{path.relative_to(ROOT)}:{call}" for path in _sources()
             for call in private_calls(path.read_text())]
    assert found == []


def test_the_private_scan_sees_an_owner_s_private_method():
    probe = "self._mine()\nsuper()._base()\nself.owner._give_back(run)\nos._exit(1)\nrun.__len__()\n"
    assert private_calls(probe) == ["3: self.owner._give_back"]
