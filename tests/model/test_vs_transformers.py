"""Our vLLM model's log-probs equal transformers' DeepseekV4ForCausalLM on the same weights.

The engine serves what a transformers user has: the reference model written by transformers'
`save_pretrained` (native-style names, transformers' config form) with the tokenizer files
copied in, loaded with the one flag `config_format="ds4"`. Prompts up to 2,600 tokens exercise
both compressors (ratio 4 and 128) and the indexer's top-512 selection (more than 512
compressed rows from 2,048 tokens on), then a few decode steps after each prompt.
"""

from __future__ import annotations

import shutil

import pytest

from tests.model.engine_helpers import (
    REFERENCE_TOLERANCE,
    greedy,
    make_engine,
    random_prompts,
    reference_logprobs,
    shutdown_engine,
)

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [7, 130, 515, 2600]
DECODE_STEPS = 5


@pytest.fixture(scope="module")
def llm(reference_model, tmp_path_factory):
    from safetensors import safe_open
    from transformers import DeepseekV4ForCausalLM

    from ds4_vllm.model.default_model import default_model_dir

    saved = tmp_path_factory.mktemp("transformers") / "saved"
    # A model transformers built, given the reference's weights: it saves the native-style layout
    # (`head.weight`, `model.layers.N.attn.wq_a.weight`, per-expert `ffn.experts.E.w1.weight`).
    fresh = DeepseekV4ForCausalLM(reference_model.config)
    fresh.load_state_dict(reference_model.state_dict())
    fresh.save_pretrained(saved)
    del fresh
    with safe_open(saved / "model.safetensors", "pt") as f:
        assert "head.weight" in f.keys() and "model.layers.0.ffn.experts.0.w1.weight" in f.keys()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, saved / name)
    engine = make_engine(model=str(saved), config_format="ds4")
    yield engine
    shutdown_engine(engine)


@pytest.fixture(scope="module")
def runs(llm):
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    params = greedy(DECODE_STEPS, logprobs=5, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return list(zip(prompts, outputs, strict=True))


@pytest.mark.parametrize("index", range(len(PROMPT_LENGTHS)), ids=[f"len{n}" for n in PROMPT_LENGTHS])
def test_prompt_logprobs_match_transformers(runs, reference_model, index):
    prompt, output = runs[index]
    ref = reference_logprobs(reference_model, prompt)
    worst = max(
        abs(output.prompt_logprobs[i][prompt[i]].logprob - float(ref[i - 1, prompt[i]]))
        for i in range(1, len(prompt))
    )
    assert worst < REFERENCE_TOLERANCE, f"prompt of {len(prompt)} tokens: max |Δ logprob| = {worst}"


@pytest.mark.parametrize("index", range(len(PROMPT_LENGTHS)), ids=[f"len{n}" for n in PROMPT_LENGTHS])
def test_decode_steps_match_transformers(runs, reference_model, index):
    prompt, output = runs[index]
    generated = list(output.outputs[0].token_ids)
    assert len(generated) == DECODE_STEPS
    for step, candidates in enumerate(output.outputs[0].logprobs):
        # The reference sees exactly the context vLLM saw at this step.
        ref = reference_logprobs(reference_model, prompt + generated[:step])[-1]
        assert int(ref.argmax()) == generated[step], f"greedy token differs at decode step {step}"
        worst = max(abs(lp.logprob - float(ref[token])) for token, lp in candidates.items())
        assert worst < REFERENCE_TOLERANCE, f"decode step {step}: max |Δ logprob| = {worst}"
