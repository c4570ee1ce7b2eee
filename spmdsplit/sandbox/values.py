"""A function's returned value, carried from the program's process to the rank as JSON without
losing what an equality test sees (standard library only: the runner imports it).

verl compares the program's own object with the expected one (`==`), after checking that
`json.dumps` takes it. Plain JSON would lose what that comparison tells apart: a tuple is not a
list there (`[(1, 2)] != [[1, 2]]`) and a dict's keys keep their type (`{1: 2} != {"1": 2}`).
So tuples and dicts are tagged: a tuple is `{"tuple": [...]}`, a dict `{"dict": [[key, value],
...]}`, and no other JSON object appears. Everything else is what `json.dumps` writes, which also
fixes the domain: `encode` takes exactly what `json.dumps` takes (the caller calls it first).

What is carried is the value, not the object: a subclass of int, str, list... arrives as the base
type, so an object whose `__eq__` says yes to anything compares as its plain value here (in
verl it passes every test).
"""

from __future__ import annotations

from typing import Any

TUPLE = "tuple"
DICT = "dict"


def encode(value: Any) -> Any:
    """`value` as JSON-ready data with tuples and dicts tagged. Checks in json's own order (str
    before int, bool before int, list/tuple before dict), so subclasses land where json puts them."""
    if isinstance(value, str):
        return str(value)
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, tuple):
        return {TUPLE: [encode(item) for item in value]}
    if isinstance(value, dict):
        return {DICT: [[encode(key), encode(item)] for key, item in value.items()]}
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def decode(data: Any) -> Any:
    """The value `encode` was given (its plain-typed copy). Raises ValueError on data `encode`
    cannot have written (it comes from the program's process, which may write anything)."""
    if isinstance(data, list):
        return [decode(item) for item in data]
    if isinstance(data, dict):
        if len(data) != 1:
            raise ValueError("a JSON object that is not a tagged tuple or dict")
        (tag, items), = data.items()
        if tag == TUPLE and isinstance(items, list):
            return tuple(decode(item) for item in items)
        if tag == DICT and isinstance(items, list):
            pairs = []
            for pair in items:
                if not (isinstance(pair, list) and len(pair) == 2) or isinstance(pair[0], (list, dict)):
                    raise ValueError("a dict entry that is not a [key, value] pair with a plain key")
                pairs.append((pair[0], decode(pair[1])))
            return dict(pairs)
        raise ValueError(f"unknown tag {tag!r}")
    return data
