"""Pickling for the payload: cloudpickle, keeping the source file names of code objects.

cloudpickle replaces the file name of every function it sends by value with
``"<dynamic-code>"``. A traceback from a rank would then lose the user's source lines, which the
notebook finds through that file name (ipykernel's cell files, or the script's path).
"""

from __future__ import annotations

import io
import types
from collections import ChainMap
from typing import Any, ClassVar

import cloudpickle

_DYNAMIC = "<dynamic-code>"


def _code_reduce_keeping_filename(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
    constructor, args = cloudpickle.cloudpickle._code_reduce(code)
    return constructor, tuple(code.co_filename if arg == _DYNAMIC else arg for arg in args)


class Pickler(cloudpickle.Pickler):
    """A cloudpickle pickler whose code objects keep their ``co_filename``."""

    dispatch_table: ClassVar[ChainMap[Any, Any]] = ChainMap(
        {types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table
    )


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps`` that keeps source file names (load with ``cloudpickle.loads``)."""
    with io.BytesIO() as buffer:
        Pickler(buffer).dump(obj)
        return buffer.getvalue()
