"""A fix for Triton 3.6's CPU interpreter with NumPy >= 2.4 (used only under TRITON_INTERPRET=1).

Triton's interpreter turns a loaded scalar into a Python int (``range(n)`` over ``n =
tl.load(ptr)``, which every kernel here does for its tile loops) with ``int(data)`` where
``data`` is a one-element array of shape ``(1,)``. NumPy 2.4 made that conversion an error
("only 0-dimensional arrays can be converted to Python scalars"), so on Triton 3.6 every such
kernel fails in the interpreter. Triton 3.9 squeezes the array first; this applies the same
one-line change to an interpreter that does not, before the first launch.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

__all__ = ["patch_scalar_index"]

_MARK = "_pagedcore_scalar_index"


def patch_scalar_index(interpreter: ModuleType | None = None) -> bool:
    """Make the interpreter's ``tensor.__index__`` squeeze its data before ``int()``.

    ``interpreter`` defaults to ``triton.runtime.interpreter``. Returns True when the patch was
    applied now, False when it is not needed (the interpreter already squeezes, or has no
    ``_patch_lang_tensor`` to wrap) or was applied before.
    """
    if interpreter is None:
        from triton.runtime import interpreter as default

        interpreter = default
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, _MARK, False):
        return False
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return False
    if "__index__" not in source or "squeeze" in source:
        return False

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    setattr(patched, _MARK, True)
    interpreter._patch_lang_tensor = patched  # type: ignore[union-attr]
    return True
