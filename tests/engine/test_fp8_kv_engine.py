"""The engine with an fp8 KV cache against the same model with a float32 cache.

Tiny Llama and Qwen2 (initializer_range 0.1, float32 weights, reference backend on the CPU):
every request's full next-token distribution (``logprobs`` = the whole 128-token vocabulary)
along the float32 run's greedy tokens, teacher-forced through prompts that extend each other
(so the later ones continue a cached fp8 prefix). Bounds (docs/engine.md, "FP8 KV cache"):
mean KL(fp32 || fp8) <= 2e-3 nats for e4m3 and <= 8e-3 for e5m2; the top-1 token agrees
wherever the fp32 top two are more than 0.1 nats apart (e5m2: 0.2), and in >= 75 % of
positions. An e4m3 element carries a relative rounding error of at most u = 2**-4 (e5m2:
2**-3); the KL is second order in the logit error, so the bound scales with u**2 (e5m2 gets
4x). Measured (session of this change): e4m3 6e-4 / 1e-3, e5m2 1.5e-3 / 5e-3 (Qwen2 /
Llama), flips only at gaps of 0.01-0.14 nats.
"""

from __future__ import annotations

import math

import pytest
from engine_helpers import make_models, random_prompts

from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams

VOCAB = 128
BOUNDS = {"fp8_e4m3": 2e-3, "fp8_e5m2": 8e-3}
#: Largest fp32 top-1 / top-2 log-probability gap at which fp8 may swap the two (e5m2 has
#: one mantissa bit less: twice the rounding error).
MARGIN = {"fp8_e4m3": 0.1, "fp8_e5m2": 0.2}


def _dists(llm: LLM, prompts: list[list[int]]) -> list[dict[int, float]]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=VOCAB)
    outs = llm.generate(prompts, params)
    result = []
    for out in outs:
        logprobs = out.outputs[0].logprobs
        assert logprobs is not None
        result.append({t: float(v) for t, v in logprobs[0].items()})
    return result


def _engine(eng: object, kv: str) -> LLM:
    return LLM(eng, device="cpu", block_size=4, max_model_len=128, max_num_batched_tokens=32,
               kv_cache_dtype=kv, max_logprobs=VOCAB, enforce_eager=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_logits_close_to_fp32_kv(arch: str, kv: str) -> None:
    _config, _ref, eng = make_models(arch)
    base = random_prompts([9, 23, 40])
    # Growing prefixes of each prompt: later requests continue a cached prefix.
    prompts = [p[:n] for p in base for n in range(4, len(p) + 1, 3)]
    exact = _dists(_engine(eng, "auto"), prompts)
    llm = _engine(eng, kv)
    assert llm.stats()["kv_scales"]["source"] == "pending (first prefill)"
    quant = _dists(llm, prompts)
    stats = llm.stats()
    assert stats["kv_cache_dtype"] == kv and stats["kv_scales"]["source"] == "first prefill"
    kls, agree, flips = [], 0, []
    for p, q in zip(exact, quant, strict=True):
        assert len(p) == len(q) == VOCAB
        kls.append(sum(math.exp(lp) * (lp - q[t]) for t, lp in p.items()))
        first, second = sorted(p.values(), reverse=True)[:2]
        same = max(p, key=p.__getitem__) == max(q, key=q.__getitem__)
        agree += same
        if not same:
            flips.append(first - second)
    mean_kl = sum(kls) / len(kls)
    print(f"{arch} {kv}: mean KL {mean_kl:.2e}, top-1 {agree}/{len(kls)}, "
          f"flip margins {[round(f, 3) for f in flips]}")
    assert mean_kl <= BOUNDS[kv], mean_kl
    # Random tiny models have near-ties; a flip is allowed only where the fp32 run's top two
    # log-probabilities are within MARGIN of each other.
    assert all(f < MARGIN[kv] for f in flips), flips
    assert agree >= 0.75 * len(kls)
    # The fp8 cache is really in use: the logits are not bit-identical to the fp32 run's.
    assert max(kls) > 0


def test_fp8_kv_cache_holds_about_twice_the_blocks() -> None:
    _config, _ref, eng = make_models("llama")
    budget = 1 << 20
    blocks = {kv: LLM(eng, device="cpu", block_size=4, max_model_len=128,
                      kv_cache_memory_bytes=budget, kv_cache_dtype=kv).kv_cache_config.num_blocks
              for kv in ("auto", "fp8")}
    # float32 -> fp8: 4x fewer bytes per element.
    assert blocks["fp8"] >= 3.9 * blocks["auto"], blocks


def test_bad_kv_cache_dtype_is_a_clear_error() -> None:
    _config, _ref, eng = make_models("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(eng, device="cpu", kv_cache_dtype="int8")


def test_generate_cli_runs_with_an_fp8_cache() -> None:
    from click.testing import CliRunner

    from pagedcore.cli import main

    result = CliRunner().invoke(main, ["generate", "--model", "demo", "--device", "cpu",
                                       "--prompt", "Hi", "--max-tokens", "3",
                                       "--kv-cache-dtype", "fp8"])
    assert result.exit_code == 0, result.output
    assert "(3 tokens, length)" in result.output


def test_captured_mixed_steps_wait_for_the_first_prefill_scales() -> None:
    """A captured mixed step replays without Python, so it cannot calibrate: while any layer's
    scales are pending, the runner must not even ask the mixed graphs for a bucket."""
    _config, _ref, eng = make_models("llama")
    llm = _engine(eng, "fp8")
    asked: list[str] = []

    class Probe:  # stands in for MixedGraphs: records when it is asked, never replays
        def bucket_for(self, inputs: object) -> None:
            asked.append(llm.stats()["kv_scales"]["source"])

    llm.runner.mixed_graphs = Probe()  # type: ignore[assignment]
    llm.generate([random_prompts([12])[0]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert asked and set(asked) == {"first prefill"}, asked


def test_zero_first_prefill_keeps_scale_one_with_a_warning() -> None:
    import torch

    from pagedcore.engine.models.attention_hook import KVScaleCalibration

    class Impl:
        scales: tuple[float, float] | None = None

        def set_kv_scales(self, k: float, v: float) -> None:
            self.scales = (k, v)

    impl, cal = Impl(), KVScaleCalibration("fp8_e4m3", layer=3)
    key = torch.zeros(4, 2, 8)
    value = torch.full((4, 2, 8), 896.0)
    slots = torch.tensor([0, 1, 2, -1])
    with pytest.warns(RuntimeWarning, match=r"layer 3: the first prefill's K is all zero"):
        cal.maybe_calibrate(impl, key, value, slots)  # type: ignore[arg-type]
    assert impl.scales == (1.0, 2.0) and not cal.pending
    key[0, 0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="not finite"):
        KVScaleCalibration("fp8_e5m2", layer=0).maybe_calibrate(
            impl, key, value, slots)  # type: ignore[arg-type]
    assert impl.scales == (1.0, 896.0 / 57344.0)
