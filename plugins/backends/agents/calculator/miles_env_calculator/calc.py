"""The ``calculate`` tool's evaluator: arithmetic on numbers with ``+ - * /``, unary minus and
parentheses, parsed by Python's ``ast`` and walked node by node. Model text is never run as
code: any other node (a name, a call, an attribute, ``**``) is refused, and the expression's
length, nesting depth and the size of every intermediate value are bounded."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

#: Longest expression accepted, in characters.
MAX_CHARS = 200
#: Deepest nesting of operations accepted.
MAX_DEPTH = 20
#: Largest magnitude of any value met on the way.
MAX_VALUE = 10.0**15

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class CalcError(ValueError):
    """An expression the calculator refuses, with the reason."""


def _bounded(value: float) -> float:
    if abs(value) > MAX_VALUE:
        raise CalcError(f"a value is above {MAX_VALUE:g} in magnitude")
    return value


def _walk(node: ast.AST, depth: int) -> float:
    if depth > MAX_DEPTH:
        raise CalcError(f"the expression nests deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalcError(f"only numbers are allowed, not {node.value!r}")
        return _bounded(float(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left, depth + 1), _walk(node.right, depth + 1)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalcError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    what = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node).__name__
    raise CalcError(f"{what} is not allowed: only numbers, + - * /, and parentheses")


def calculate(expression: str) -> float:
    """The value of an arithmetic ``expression``; :class:`CalcError` names what is refused."""
    if not isinstance(expression, str):
        raise CalcError(f"expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalcError(f"not an arithmetic expression: {exc.msg}") from None
    return _walk(tree.body, 0)


def format_number(value: float) -> str:
    """A result as the tool shows it: an integer without ``.0``, else up to 6 decimals."""
    if value == int(value):
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")
