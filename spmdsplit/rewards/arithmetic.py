"""Python arithmetic written in a model's answer, read without `eval`.

Some graders (the ToRA comparison in rewards/prime_math.py) hand an answer to Python's `eval` to
turn `2*3.14159` or `[1, 2]` into a number or a list. Model output must never run as code, so
only what arithmetic needs is evaluated here: numbers (int, float, complex), the unary and binary
operators, and tuples, lists and sets of them. Anything else (a name, a call, an attribute, a
string, a comparison) raises NotArithmetic, where `eval` would have run it. Within what it
accepts, the value is `eval`'s, errors included (`1/0` raises ZeroDivisionError, `2.0 ^ 1`
TypeError), except that integer powers and shifts too large to compute quickly raise instead of
holding the interpreter (one such step cannot be interrupted, not even by usercode.call_within).
"""

from __future__ import annotations

import ast
import numbers
import operator

MAX_INT_BITS = 1 << 16  # an integer power or left shift whose result could pass this is refused

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.BitXor: operator.xor, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
    ast.LShift: operator.lshift, ast.RShift: operator.rshift,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert}
_COLLECTIONS = {ast.Tuple: tuple, ast.List: list, ast.Set: set}


class NotArithmetic(ValueError):
    """The text is not plain arithmetic (or its value is too large to compute)."""


def _parse(text: str) -> ast.expr:
    # eval drops leading spaces and tabs before compiling; ast.parse would call them an indent.
    return ast.parse(text.lstrip(" \t"), mode="eval").body


def _too_large(op: ast.operator, left, right) -> bool:
    if not (isinstance(left, int) and isinstance(right, int)):
        return False  # floats overflow (OverflowError) or go to inf at once
    if isinstance(op, ast.Pow):
        return abs(left) > 1 and right > 0 and right * left.bit_length() > MAX_INT_BITS
    return isinstance(op, ast.LShift) and left != 0 and right + left.bit_length() > MAX_INT_BITS


def _value(node: ast.expr):
    if isinstance(node, ast.Constant):
        if isinstance(node.value, numbers.Number) and not isinstance(node.value, bool):
            return node.value
        raise NotArithmetic(f"not a number: {node.value!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if _too_large(node.op, left, right):
            raise NotArithmetic("an integer too large to compute")
        return _BINARY[type(node.op)](left, right)
    if type(node) in _COLLECTIONS:
        return _COLLECTIONS[type(node)](_value(element) for element in node.elts)
    raise NotArithmetic(f"not arithmetic: {type(node).__name__}")


def evaluate(text: str):
    """The value `eval(text)` would give, for arithmetic only (NotArithmetic for anything else;
    SyntaxError where eval raises it; the operators' own errors as they raise them)."""
    return _value(_parse(text))


def is_plain_call(text: str, function: str, inner_functions: tuple[str, ...] = ()) -> bool:
    """True when `text` is the one call `function(...)` whose arguments hold only numbers,
    operators, tuples, lists, bare names and calls of `inner_functions` (positional arguments
    only; no attributes, subscripts or strings). Such text is safe for sympy's `parse_expr`, which
    runs `eval`: a bare name becomes a symbol or a sympy object, and only the named functions run."""
    try:
        call = _parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == function):
        return False
    for node in ast.walk(call):
        if isinstance(node, ast.Call):
            if node.keywords or not isinstance(node.func, ast.Name) or (
                    node is not call and node.func.id not in inner_functions):
                return False
        elif isinstance(node, ast.Name):
            if node.id.startswith("_"):
                return False
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, numbers.Number) or isinstance(node.value, bool):
                return False
        elif not isinstance(node, (ast.UnaryOp, ast.BinOp, ast.Tuple, ast.List, ast.unaryop, ast.operator,
                                   ast.expr_context)):
            return False
    return True
