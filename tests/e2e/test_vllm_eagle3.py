"""A real vLLM (its CPU build) serves the kit's own vLLM export with EAGLE-3 speculative decoding: vLLM's
acceptance counters (tau = 1 + accepted / drafts) agree with `eaglekit evaluate`'s real loop and offline
estimate on the same prompts, and speculation changes no output (greedy: vLLM's answers equal plain greedy).

A draft that vLLM loaded with random weights (a misnamed tensor) accepts nothing, so tau near 1.0 fails here.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglekit.analysis.evaluate import evaluate_draft
from eaglekit.analysis.live_serving import measure_vllm
from eaglekit.draft.export import export_vllm, load_export
from eaglekit.generation.server import VLLMServer
from eaglekit.target import target_layout
from eaglekit.topology import Topology
from support import fit_draft_on_greedy_answers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

QUESTIONS = [
    "Name two colors.",
    "What is two plus two?",
    "Say hello in French.",
    "What is the capital of Italy?",
]
MAX_NEW_TOKENS = 24
SPECULATIVE_TOKENS = 3


@pytest.fixture(scope="module")
def live_and_offline(embedded_model_dir, vllm_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_eagle3")
    draft, prompts, sequences = fit_draft_on_greedy_answers(embedded_model_dir, QUESTIONS, MAX_NEW_TOKENS)
    export = export_vllm(
        draft,
        target_layout(embedded_model_dir),
        root / "export",
        dtype=torch.float32,
        verifier_name_or_path=str(embedded_model_dir),
    )
    target = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    eos = sorted(
        {
            tokenizer.eos_token_id,
            *(
                [target.generation_config.eos_token_id]
                if isinstance(target.generation_config.eos_token_id, int)
                else target.generation_config.eos_token_id or []
            ),
        }
        - {None}
    )
    offline = evaluate_draft(
        target,
        load_export(export).eval(),
        prompts,
        [Topology.chain(SPECULATIVE_TOKENS)],
        MAX_NEW_TOKENS,
        eos,
        prompt_names=[f"q{index}" for index in range(len(prompts))],
        num_resamples=200,
    ).records()[0]
    speculative_config = {
        "method": "eagle3",
        "model": str(export),
        "num_speculative_tokens": SPECULATIVE_TOKENS,
    }
    with VLLMServer(
        embedded_model_dir,
        python=vllm_python,
        speculative_config=speculative_config,
        log_path=root / "vllm.log",
    ) as server:
        token_prompts = [{"id": f"q{index}", "input_ids": prompt} for index, prompt in enumerate(prompts)]
        summary, _ = measure_vllm(
            server.base_url, token_prompts, server.model_name, max_tokens=MAX_NEW_TOKENS
        )
        texts = []
        with httpx.Client(timeout=300) as client:
            for prompt in prompts:
                answer = client.post(
                    f"{server.base_url}/completions",
                    json={
                        "model": server.model_name,
                        "prompt": prompt,
                        "max_tokens": MAX_NEW_TOKENS,
                        "temperature": 0,
                    },
                ).json()
                texts.append(answer["choices"][0]["text"])
    # Plain greedy decoding of the target, up to its first end-of-turn token (where vLLM stops).
    answers = [sequence[len(prompt) :] for prompt, sequence in zip(prompts, sequences)]
    answers = [
        answer[: next((index for index, token in enumerate(answer) if token in eos), len(answer))]
        for answer in answers
    ]
    return (
        summary.iloc[0],
        offline,
        texts,
        [tokenizer.decode(answer, skip_special_tokens=True) for answer in answers],
    )


def test_vllm_serves_the_kit_export_with_the_accept_length_the_kit_measures(live_and_offline):
    live, offline, _, _ = live_and_offline
    print(
        f"\nchain {SPECULATIVE_TOKENS}, {len(QUESTIONS)} prompts x {MAX_NEW_TOKENS} tokens: "
        f"vLLM tau {live.tau_pooled:.3f} ({live.verification_steps} drafts), "
        f"kit loop {offline['tau_loop']:.3f}, kit offline {offline['tau_offline']:.3f}"
    )
    assert live.tau_pooled > 1.5, (
        "vLLM accepted almost nothing: the export's weights were not loaded as trained"
    )
    low, high = offline["tau_loop_interval"]
    assert low - 0.25 <= live.tau_pooled <= high + 0.25, (live.tau_pooled, offline["tau_loop"], (low, high))


def test_speculation_in_vllm_changes_no_output(live_and_offline):
    _, _, texts, greedy = live_and_offline
    assert [text.strip() for text in texts] == [text.strip() for text in greedy]
