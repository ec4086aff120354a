"""The Triton 3.6 interpreter fix (`pagedcore_triton._interpreter_compat`), on a stand-in of the
old interpreter module (CI runs a Triton whose interpreter needs no fix)."""

from __future__ import annotations

import importlib.util
import inspect
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pagedcore_triton._interpreter_compat import patch_scalar_index

#: Triton 3.6's `_patch_lang_tensor`, reduced to the line that matters.
_OLD = """
def _patch_lang_tensor(tensor, scope):
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))
"""


class _Scope:
    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        setattr(obj, name, value)


class _Tensor:
    def __init__(self, data: np.ndarray) -> None:
        self.handle = types.SimpleNamespace(data=data)


def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("old_interpreter", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_patched_index_accepts_a_one_element_array(tmp_path: Path) -> None:
    path = tmp_path / "old_interpreter.py"
    path.write_text(_OLD)
    module = _load(path)
    module._patch_lang_tensor(_Tensor, _Scope())
    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        with pytest.raises(TypeError, match="0-dimensional"):
            range(_Tensor(np.array([5], dtype=np.int32)))  # type: ignore[call-overload]
    assert patch_scalar_index(module) is True
    module._patch_lang_tensor(_Tensor, _Scope())
    assert list(range(_Tensor(np.array([3], dtype=np.int32)))) == [0, 1, 2]  # type: ignore[call-overload]
    assert patch_scalar_index(module) is False  # applied once only


def test_an_interpreter_that_already_squeezes_is_left_alone() -> None:
    from triton.runtime import interpreter

    source = inspect.getsource(interpreter._patch_lang_tensor)
    if "squeeze" not in source:
        pytest.skip("this Triton's interpreter needs the fix")
    before = interpreter._patch_lang_tensor
    assert patch_scalar_index(interpreter) is False
    assert interpreter._patch_lang_tensor is before
