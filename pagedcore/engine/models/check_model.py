"""`check_model`: does the engine run this model token-identically to transformers?

The model is loaded once; transformers' own forward (eager attention) on a copy of the same
weights is the reference. A few seeded prompts are decoded greedily by both (EOS ignored); the
report says whether every token agreed and how far the engine's log-probabilities of the chosen
tokens are from transformers'. An architecture the engine cannot run is reported with its
reasons instead (`pagedcore.engine.models.support`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from pagedcore.engine.engine_args import EngineArgs

__all__ = ["FLOAT32_LOGPROB_TOLERANCE", "ModelCheck", "check_model"]

#: In float32 the engine's log-probabilities must also agree this closely (in half precision
#: kernels legitimately differ more; there only the tokens are held to identity).
FLOAT32_LOGPROB_TOLERANCE = 1e-3


@attrs.frozen(kw_only=True)
class ModelCheck:
    """What `check_model` found."""

    model: str
    model_type: str | None
    #: Why the engine cannot run it (empty: it ran).
    problems: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    dtype: str = ""
    prompt_lengths: tuple[int, ...] = ()
    num_tokens: int = 0
    #: Prompts whose greedy tokens all agreed.
    identical_prompts: int = 0
    #: Largest |engine - transformers| log-probability of a token both chose.
    max_logprob_diff: float | None = None
    #: First divergence: (prompt index, step, engine token, transformers token).
    first_divergence: tuple[int, int, int, int] | None = None

    @property
    def passed(self) -> bool:
        """Every prompt's greedy tokens equal transformers' (and, in float32, the
        log-probabilities within `FLOAT32_LOGPROB_TOLERANCE`)."""
        if self.problems or not self.identical_prompts == len(self.prompt_lengths) > 0:
            return False
        return self.dtype != "float32" or (self.max_logprob_diff or 0.0) <= (
            FLOAT32_LOGPROB_TOLERANCE)

    def summary(self) -> str:
        """One line per finding, for the CLI."""
        if self.problems:
            return f"{self.model}: cannot run on the pagedcore engine: " + "; ".join(
                self.problems)
        lines = [
            f"{self.model} ({self.model_type}, {self.dtype}, backend "
            f"{', '.join(sorted(set(self.backends)))}): greedy tokens "
            f"{'identical' if self.passed else 'DIFFER'} on {self.identical_prompts}/"
            f"{len(self.prompt_lengths)} prompts of {self.num_tokens} tokens (prompt lengths "
            f"{', '.join(map(str, self.prompt_lengths))}); max |logprob diff| "
            f"{self.max_logprob_diff:.2e}"
            + ("" if self.dtype != "float32" else f" (tolerance {FLOAT32_LOGPROB_TOLERANCE:g})")
            + ("" if self.passed else ": FAILED")
        ]
        if self.first_divergence is not None:
            i, step, got, want = self.first_divergence
            lines.append(f"first divergence: prompt {i}, step {step}: engine chose {got}, "
                         f"transformers {want}")
        return "\n".join(lines)


def _reference_greedy(model: Any, prompt: list[int], num_tokens: int) -> tuple[list[int], Any]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device),
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([x[0] for x in out.logits]).float().log_softmax(-1).cpu()


def check_model(
    args: EngineArgs, *, num_tokens: int = 8, prompt_lengths: tuple[int, ...] = (7, 23),
    seed: int = 0,
) -> ModelCheck:
    """Greedy parity of the engine with transformers on `args.model`.

    Parameters
    ----------
    args:
        How to build the engine (model, device, dtype, backend, ...).
    num_tokens:
        Tokens generated per prompt.
    prompt_lengths:
        One prompt of random token ids (seeded by `seed`) per length.

    Returns
    -------
    ModelCheck
        ``.passed`` when every token agreed; ``.problems`` when the architecture cannot run.

    Raises
    ------
    ValueError
        The model cannot be found or loaded (the message says why).
    """
    import torch

    from pagedcore.engine.llm import LLM
    from pagedcore.engine.models.loading import load_model
    from pagedcore.engine.models.support import UnsupportedModelError
    from pagedcore.engine.resources import resolve_device, resolve_dtype
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    name = str(args.model) if isinstance(args.model, str) else type(args.model).__name__
    try:
        loaded = load_model(args.model, dtype=dtype, device=device, seed=args.seed,
                            trust_remote_code=args.trust_remote_code)
    except UnsupportedModelError as err:
        return ModelCheck(model=name, model_type=None, problems=(str(err),))
    config = loaded.model.config
    reference = copy.deepcopy(loaded.model)
    reference.set_attn_implementation("eager")
    longest = max(prompt_lengths) + num_tokens
    llm = LLM.from_engine_args(attrs.evolve(
        args, model=loaded.model, tokenizer=loaded.tokenizer,
        max_model_len=min(int(config.max_position_embeddings), max(longest, 64)),
        log_stats=False))
    g = torch.Generator().manual_seed(seed)
    vocab = int(config.vocab_size)
    prompts = [torch.randint(min(3, vocab - 1), vocab, (n,), generator=g).tolist()
               for n in prompt_lengths]
    outs = llm.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                                ignore_eos=True, logprobs=1))
    identical, worst = 0, 0.0
    divergence: tuple[int, int, int, int] | None = None
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        want, ref_logprobs = _reference_greedy(reference, prompt, num_tokens)
        got = list(out.outputs[0].token_ids)
        if got == want:
            identical += 1
        elif divergence is None:
            step = next(s for s, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            divergence = (i, step, got[step], want[step])
        for step, entry in enumerate(out.outputs[0].logprobs or []):
            value = entry.get(got[step]) if step < len(want) else None
            if value is not None and got[step] == want[step]:
                mine = float(getattr(value, "logprob", value))
                worst = max(worst, abs(mine - float(ref_logprobs[step, got[step]])))
    return ModelCheck(
        model=name, model_type=getattr(config, "model_type", None),
        backends=tuple(llm.backend_names), dtype=str(dtype).removeprefix("torch."),
        prompt_lengths=tuple(prompt_lengths), num_tokens=num_tokens,
        identical_prompts=identical, max_logprob_diff=worst, first_divergence=divergence,
    )
