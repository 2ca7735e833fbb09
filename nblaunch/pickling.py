"""Pickling for the payload: cloudpickle, with two corrections.

- cloudpickle replaces the file name of every function it sends by value with
  ``"<dynamic-code>"``. A traceback from a rank would then lose the user's source lines, which
  the notebook finds through that file name (ipykernel's cell files, or the script's path).
- cloudpickle ships every ``sys.modules`` entry ``package.name`` whose ``name`` a function uses,
  assuming it is a plain module. ``torch.ops`` is an instance of a module subclass that
  cloudpickle cannot reduce, so a function using torch and any global named ``ops``
  (``from nblaunch import ops``) would fail to pickle. Such entries are left out: the rank
  imports torch, which creates them.
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

    def _dynamic_function_reduce(self, func: types.FunctionType) -> tuple[Any, ...]:
        reduced = super()._dynamic_function_reduce(func)
        _, slotstate = reduced[2]
        submodules = slotstate.get("_cloudpickle_submodules", [])
        # Only plain modules reach cloudpickle's module reducer (keyed by exact type).
        slotstate["_cloudpickle_submodules"] = [
            module for module in submodules if type(module) is types.ModuleType
        ]
        return reduced


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps`` that keeps source file names (load with ``cloudpickle.loads``)."""
    with io.BytesIO() as buffer:
        Pickler(buffer).dump(obj)
        return buffer.getvalue()
