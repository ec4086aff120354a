"""Issue #25 item 6: `EngineArgs` is the one definition of the engine's options; `LLM(...)`'s
keywords are its fields (same names and defaults) and validation goes through it."""

from __future__ import annotations

import inspect

import attrs
import pytest

from pagedcore import LLM
from pagedcore.engine.engine_args import EngineArgs
from pagedcore.engine.validation import InvalidArgumentError, InvalidArgumentTypeError


def test_llm_keywords_are_the_engine_args_fields() -> None:
    params = inspect.signature(LLM.__init__).parameters
    fields = attrs.fields_dict(EngineArgs)
    assert {n for n in params if n != "self"} == set(fields)
    for name, field in fields.items():
        if name != "model":
            assert params[name].default == field.default, name
        assert field.metadata["help"].strip(), f"{name} has no help text"


def test_every_bad_field_is_named_at_once() -> None:
    with pytest.raises(InvalidArgumentTypeError) as info:
        EngineArgs(max_num_seqs="8", block_size=0, kv_cache_dtype="int4", log_interval=0)
    message = str(info.value)
    for needle in ("max_num_seqs", "block_size", "kv_cache_dtype", "log_interval"):
        assert needle in message


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_kv_cache_dtype_names(kv: str) -> None:
    args = EngineArgs(kv_cache_dtype=kv)
    assert args.resolved_kv_cache_dtype == ("fp8_e4m3" if kv == "fp8" else kv)


def test_llm_validates_through_engine_args_before_loading() -> None:
    with pytest.raises(InvalidArgumentError, match="trust_remote_code must be True or False"):
        LLM("no/such-model", trust_remote_code="yes")


def test_from_engine_args_builds_the_same_engine() -> None:
    args = EngineArgs(model="demo", device="cpu", max_model_len=64, max_num_seqs=3,
                      block_size=8, kv_cache_memory_bytes=1 << 20)
    llm = LLM.from_engine_args(args)
    assert llm.engine_args is args
    assert llm.scheduler_config.max_num_seqs == 3 and llm.max_model_len == 64
    assert llm.kv_cache_config.groups[0].spec.block_size == 8
