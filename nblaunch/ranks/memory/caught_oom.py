"""Out-of-memory errors a library caught on one rank and retried alone.

Accelerate's documented ``find_executable_batch_size`` (Transformers' ``auto_find_batch_size``
uses it too) catches an out-of-memory error and calls the function again with a smaller batch,
on the rank that ran out only. Its peers go on at the old size, and the ranks' collectives part
ways: the checks then report a mismatch ("all_reduce [32] vs [8]") or the hang watchdog a rank
waiting forever, neither of which says memory. So a rank tells the notebook each time such a
finder catches an out-of-memory error (a ``Progress`` event, ``what=OOM_CAUGHT``), and the
notebook names that rank as the cause when the ranks then disagree
(:func:`nblaunch.engine.verdict.exception_for`), with nblaunch's
:func:`~nblaunch.ranks.memory.batch_size.find_executable_batch_size` as the fix: it keeps every
rank on the same batch size.

Accelerate decides with ``accelerate.utils.memory.should_reduce_batch_size``, looked up in its
module when the finder catches an error: that function is wrapped when the module is imported
(a finder on ``sys.meta_path``, put there when this module is imported: in the forkserver,
before any rank imports Accelerate), or at once if it was imported already.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator
from typing import Any

from nblaunch.events import OOM_CAUGHT
from nblaunch.ranks import this_rank

ACCELERATE_MEMORY = "accelerate.utils.memory"


# The batch sizes that ran out of memory in this task, in order (each catch tells them all).
_sizes: list[int] = []


@contextlib.contextmanager
def _new_task(context: this_rank.RankContext) -> Iterator[None]:
    _sizes.clear()
    yield


this_rank.add_task_hook(_new_task)


def report(finder: str, batch_size: Any, exception: BaseException) -> None:
    """Tell the notebook that ``finder`` caught ``exception`` (out of memory) on this rank at
    ``batch_size`` and retries this rank alone; the story so far is in each report."""
    rank = this_rank.rank()
    if isinstance(batch_size, int):
        _sizes.append(batch_size)
    sizes = ", ".join(map(str, _sizes))
    message = (str(exception).splitlines() or [type(exception).__name__])[0][:200]
    this_rank.emit(
        {
            "kind": "progress",
            "rank": rank,
            "what": OOM_CAUGHT,
            "text": f"rank {rank}: out of memory{f' at batch_size={sizes}' if sizes else ''}, "
            f"caught by {finder}, which retries this rank alone at a smaller batch size",
            "data": {"finder": finder, "sizes": list(_sizes), "error": message},
        }
    )


def wrap_accelerate(module: Any) -> None:
    """Wrap ``should_reduce_batch_size`` of Accelerate's memory module (once)."""
    original = getattr(module, "should_reduce_batch_size", None)
    if original is None or hasattr(original, "__nblaunch_original__"):
        return

    def should_reduce_batch_size(exception: Exception) -> bool:
        reduce = original(exception)
        if reduce and this_rank.current() is not None:
            # The finder's frame holds the batch size that ran out (its closure's variable).
            caller = sys._getframe(1)
            size = caller.f_locals.get("batch_size")
            del caller
            report("Accelerate's find_executable_batch_size", size, exception)
        return reduce

    should_reduce_batch_size.__wrapped__ = original  # type: ignore[attr-defined]
    should_reduce_batch_size.__nblaunch_original__ = original  # type: ignore[attr-defined]
    should_reduce_batch_size.__doc__ = original.__doc__
    module.should_reduce_batch_size = should_reduce_batch_size


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps Accelerate's memory module right after it is imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != ACCELERATE_MEMORY:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        execute = loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            wrap_accelerate(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Wrap Accelerate's memory module now if imported, else when it is."""
    if ACCELERATE_MEMORY in sys.modules:
        wrap_accelerate(sys.modules[ACCELERATE_MEMORY])
    elif not any(isinstance(finder, _WrapOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())


install()
