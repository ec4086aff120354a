"""The conformance suite accepts the reference and rejects every planted broken backend."""

from __future__ import annotations

import pytest
import torch
from broken_backends import BROKEN, BROKEN_FULL, SplitEdgeMisread

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


@pytest.mark.parametrize("name", list(BROKEN_FULL))
def test_broken_backend_is_rejected_by_the_full_suite(name: str) -> None:
    backend, case_filter = BROKEN_FULL[name]
    report = run_suite(backend, device="cpu", case_filter=case_filter)
    assert not report.passed, f"{name} slipped through:\n{report.summary()}"
    reference = run_suite(ReferenceBackend, device="cpu", case_filter=case_filter)
    assert reference.passed and reference.results, reference.summary()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_needles_batch_catches_a_misread_that_a_long_random_context_hides(dtype: str) -> None:
    """A backend that reads position 2048 for 2047 (a split-edge off-by-one) passes the `long`
    batch in 16-bit dtypes: one row of 2,100 near-uniform ones moves the output by less than
    the tolerance. The `needles` batch (the same requests, with needle keys on the edges)
    rejects it by a wide margin and still passes the reference."""
    import attrs

    from pagedcore.conformance.cases import TOLERANCES, build_cases
    from pagedcore.conformance.harness import run_case

    cases = {c.batch: attrs.evolve(c, dtype=dtype) for c in build_cases(ReferenceBackend)
             if c.batch in ("long", "needles")}
    assert run_case(ReferenceBackend, cases["needles"], device="cpu").passed
    hidden = run_case(SplitEdgeMisread, cases["long"], device="cpu")
    assert hidden.passed and hidden.max_rel_error is not None
    assert hidden.max_rel_error > 0  # it does read the wrong row
    caught = run_case(SplitEdgeMisread, cases["needles"], device="cpu")
    assert not caught.passed and caught.max_rel_error is not None
    assert caught.max_rel_error > 2 * TOLERANCES[dtype], caught.message


def test_needle_keys_sit_where_the_spec_says() -> None:
    """Every needle position (negative ones from the end) of every context holds the same
    key per KV head, and no other history position does."""
    from pagedcore.conformance.cases import BATCHES, build_cases
    from pagedcore.conformance.harness import make_batch

    spec = BATCHES["needles"]
    case = next(c for c in build_cases(ReferenceBackend) if c.batch == "needles")
    batch = make_batch(case, 1)
    needle = None
    for context, keys in zip(batch.contexts, batch.keys, strict=True):
        want = {p % context for p in spec.needles if -context <= p < context}
        same = [p for p in range(context)
                if needle is not None and torch.equal(keys[p], needle)]
        if needle is None:
            needle = keys[min(want)].clone()
            same = [p for p in range(context) if torch.equal(keys[p], needle)]
        assert set(same) == want, (context, sorted(set(same) ^ want))


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
