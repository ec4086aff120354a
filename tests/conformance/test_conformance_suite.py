"""The conformance suite accepts the reference and rejects every planted broken backend."""

from __future__ import annotations

import pytest
import torch
from broken_backends import BROKEN

from pagedcore.conformance import run_suite
from pagedcore.reference import ReferenceBackend


def test_reference_passes_quick() -> None:
    report = run_suite(ReferenceBackend, quick=True, device="cpu")
    assert report.passed, report.summary()
    assert len(report.results) >= 10


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_backend_is_rejected(name: str) -> None:
    report = run_suite(BROKEN[name], quick=True, device="cpu", exitfirst=True)
    assert not report.passed, f"{name} slipped through:\n{report.summary()}"
    assert report.failures and all(r.message for r in report.failures)


def test_batches_poison_unused_slots_and_guard_the_last_block() -> None:
    """Blocks are permuted, block 0 unused, the cache's last block full, every free slot NaN."""
    from pagedcore.conformance import harness
    from pagedcore.conformance.cases import build_cases

    seen: list[torch.Tensor] = []

    class Spy(ReferenceBackend):
        @classmethod
        def get_impl_cls(cls):  # type: ignore[no-untyped-def]
            base = ReferenceBackend.get_impl_cls()

            class Impl(base):  # type: ignore[misc,valid-type]
                def forward(self, query, key, value, kv_cache, metadata, *, output=None):  # type: ignore[no-untyped-def]
                    seen.append(kv_cache.clone())
                    return super().forward(query, key, value, kv_cache, metadata, output=output)

            return Impl

    case = next(c for c in build_cases(ReferenceBackend) if c.batch == "chunked_prefill")
    batch = harness.make_batch(case, 1)
    ids = [b for blocks in batch.block_ids for b in blocks]
    assert 0 not in ids and len(set(ids)) == len(ids)
    assert ids != sorted(ids), "physical blocks are not permuted"
    assert batch.num_blocks - 1 in ids
    assert harness.run_case(Spy, case, device="cpu").passed
    cache = seen[0]
    written = sum(batch.seq_lens) * 2 * case.num_kv_heads * case.head_size
    assert int((~torch.isnan(cache)).sum()) == written
    assert torch.isnan(cache[:, 0]).all(), "the null block must stay NaN"


def test_reference_passes_full_suite_on_cpu() -> None:
    report = run_suite(ReferenceBackend, device="cpu")
    assert report.passed, report.summary()
    assert {r.name for r in report.results if r.skipped} == {
        r.name for r in report.results if "int32_overflow" in r.name
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reference_passes_full_suite_on_cuda() -> None:
    """Includes the int32-overflow case (a multi-GB cache)."""
    report = run_suite(ReferenceBackend, device="cuda")
    assert report.passed, report.summary()
    assert not any(r.skipped for r in report.results), report.summary()
