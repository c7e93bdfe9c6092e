"""Issue 8: quantized checkpoints served by our engine give transformers' log-probs on the same weights.

Three checkpoints, one engine each (module-scoped, one at a time), official numerics switched
off so both sides run the same float graph:

- `official`: the default model in the official release's form (native names, FP8 E4M3 linears
  with UE8M0 128x128 block scales, MXFP4 routed experts, BF16/F32/I64 elsewhere, the release's
  config.json keys), quantized by `quantized_checkpoints` with plain torch. The reference is
  transformers' `DeepseekV4ForCausalLM` on the weights transformers' own `Fp8Dequantize`
  computes, configured by transformers' own reading of that config.json.
- `gguf-q2`, `gguf-q4`: the embedded tiny ds4 GGUFs. The reference runs on gguf-py's numpy
  dequantization of gguf-py's reader.

Prompts are longer than 2,048 tokens, so both compressors and the indexer's top-512 selection
over more than 512 compressed rows take part; a few greedy decode steps follow each prompt.
Prompt log-probs: all but one position in 1,000 within TYPICAL_TOLERANCE (1e-4) of the
reference, every one within OUTLIER_TOLERANCE (1e-2). Measured on gguf-q2, 2,600 tokens
(2026-12-07): median 9.5e-7, p99 1.2e-5, p99.9 2.9e-5, and one position (2,517) at 1.2e-3 with
its neighbours at 3.8e-5: an isolated jump, as when float order flips a near-tie in one of the
model's discrete choices (the indexer's top 512 rows, an expert's routing). Decode steps stay
within REFERENCE_TOLERANCE (1e-3). A loader defect is far above both: swapping two experts of
one layer moves log-probs by 0.52, at many positions.
Run time about 4-5 minutes per checkpoint on 2 busy cores (transformers' reference dominates).
"""

from __future__ import annotations

import pytest

from tests.model.engine_helpers import (
    REFERENCE_TOLERANCE,
    greedy,
    make_engine,
    random_prompts,
    reference_logprobs,
    shutdown_engine,
)

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

CHECKPOINTS = ["official", "gguf-q2", "gguf-q4"]
PROMPT_LENGTHS = [2600]
DECODE_STEPS = 4
NUMERICS_OFF = {"ds4_official_numerics": False}
TYPICAL_TOLERANCE = 1e-4  # every prompt position but one in 1,000 (measured p99.9 2.9e-5)
OUTLIER_TOLERANCE = 1e-2  # the rest: a flipped near-tie (measured 1.2e-3); a defect moves 0.5


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request, tmp_path_factory):
    """(name, engine keyword arguments, transformers reference model) for one checkpoint."""
    from ds4_vllm.model.config import to_transformers_config
    from ds4_vllm.model.default_model import default_model_dir
    from ds4_vllm.model.gguf_file import Ds4GgufFile
    from ds4_vllm.model.tiny_gguf import tiny_gguf_file
    from tests.model.quantized_checkpoints import (
        gguf_reference_weights,
        official_reference_weights,
        official_transformers_config,
        transformers_model,
        write_official_checkpoint,
    )

    work = tmp_path_factory.mktemp(request.param)
    if request.param == "official":
        path = write_official_checkpoint(work / "official", default_model_dir())
        # model_type deepseek_v4 with a quantization_config: without the ds4 format vLLM picks its
        # own DeepSeek V4 class and FP8 method.
        engine = {"model": str(path), "config_format": "ds4"}
        reference = transformers_model(
            official_reference_weights(path), official_transformers_config(path), work / "reference"
        )
    else:
        path = tiny_gguf_file(f"ds4-tiny-{request.param.removeprefix('gguf-')}")
        engine = {"model": str(path)}
        config = to_transformers_config(Ds4GgufFile.open(path).config())
        reference = transformers_model(gguf_reference_weights(path), config, work / "reference")
    return request.param, engine, reference


@pytest.fixture(scope="module")
def runs(checkpoint):
    """(prompt, vLLM output) per prompt, from one engine that is shut down before the next starts."""
    _, engine_kwargs, _ = checkpoint
    llm = make_engine(**engine_kwargs, hf_overrides=NUMERICS_OFF)
    try:
        assert llm.llm_engine.model_config.hf_config.official_numerics is False
        prompts = random_prompts(PROMPT_LENGTHS, seed=23)
        params = greedy(DECODE_STEPS, logprobs=5, prompt_logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        shutdown_engine(llm)
    return list(zip(prompts, outputs, strict=True))


@pytest.mark.parametrize("index", range(len(PROMPT_LENGTHS)), ids=[f"len{n}" for n in PROMPT_LENGTHS])
def test_prompt_and_decode_logprobs_match_transformers(checkpoint, runs, index):
    name, _, reference = checkpoint
    prompt, output = runs[index]
    generated = list(output.outputs[0].token_ids)
    assert len(generated) == DECODE_STEPS
    # One causal forward over the prompt and all but the last generated token gives the reference
    # for every prompt position and every decode step.
    ref = reference_logprobs(reference, prompt + generated[:-1])
    diffs = sorted(
        abs(output.prompt_logprobs[i][prompt[i]].logprob - float(ref[i - 1, prompt[i]]))
        for i in range(1, len(prompt))
    )
    prompt_worst = diffs[-1]
    outliers = [d for d in diffs if d >= TYPICAL_TOLERANCE]
    assert len(outliers) <= len(diffs) // 1000 and prompt_worst < OUTLIER_TOLERANCE, (
        f"{name}, {len(prompt)} tokens: |Δ logprob| over {TYPICAL_TOLERANCE}: {outliers[-10:]}"
    )
    for step, candidates in enumerate(output.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + step]
        assert int(row.argmax()) == generated[step], f"{name}: greedy token differs at decode step {step}"
        worst = max(abs(lp.logprob - float(row[token])) for token, lp in candidates.items())
        assert worst < REFERENCE_TOLERANCE, f"{name}: decode step {step}: max |Δ logprob| = {worst}"
    print(f"{name} len{len(prompt)}: prompt max |Δ logprob| = {prompt_worst:.3g}")
