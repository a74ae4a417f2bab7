"""Helpers shared by tests in several folders: tiny random-weight targets and drafts, samples as stage 4
yields them, published chat-template fixtures, prompts as stage 2 writes them, a sweep record.
Importable from any test as `from support import ...` (tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eaglekit.capture import default_capture_layer_ids
from eaglekit.draft.model import (
    DraftKVCache,
    Eagle3DraftModel,
    TargetHeadWeights,
    build_draft_from_target,
    shift_left,
)
from eaglekit.draft.vocab import count_generated_tokens, select_draft_vocab
from eaglekit.topology import Topology
from eaglekit.training.record import DraftEntry, DraftVocabRecord, SweepRecord


# from tests/draft/test_model.py
TINY_TARGET = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_TARGET)).eval()


@torch.no_grad()
def samples_from_target(
    target: LlamaForCausalLM,
    count: int,
    seed: int = 0,
    datasets: tuple[str, ...] = ("alpha", "beta"),
    min_length: int = 12,
    max_length: int = 40,
) -> list[dict]:
    """Training samples exactly as stage 4 yields them, from a real (tiny) target's hidden states.

    Tokens come from greedy continuation of a random prompt, so the "generated" part is the target's
    own argmax (loss_mask 1 there), as regenerated data is.
    """
    generator = torch.Generator().manual_seed(seed)
    capture = tuple(default_capture_layer_ids(target.config.num_hidden_layers))
    samples = []
    for index in range(count):
        prompt_length = int(torch.randint(3, 8, (1,), generator=generator))
        total_length = int(torch.randint(min_length, max_length + 1, (1,), generator=generator))
        prompt = torch.randint(0, target.config.vocab_size, (1, prompt_length), generator=generator)
        input_ids = target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=total_length - prompt_length,
            min_new_tokens=total_length - prompt_length,
            do_sample=False,
            pad_token_id=0,
        )[0]
        outputs = target(input_ids[None], output_hidden_states=True)
        aux = torch.cat([outputs.hidden_states[i][0] for i in capture], dim=-1)
        loss_mask = torch.zeros_like(input_ids)
        loss_mask[prompt_length:] = 1
        samples.append(
            {
                "id": f"sample-{seed}-{index}",
                "dataset": datasets[index % len(datasets)],
                "input_ids": input_ids,
                "loss_mask": loss_mask,
                "aux_hidden_states": aux.to(torch.bfloat16),
                "final_hidden_states": outputs.hidden_states[-1][0].to(torch.bfloat16),
            }
        )
    return samples


def target_head(target: LlamaForCausalLM) -> TargetHeadWeights:
    return TargetHeadWeights(
        embed_tokens=target.model.embed_tokens.weight.detach().clone(),
        lm_head=target.lm_head.weight.detach().clone(),
        final_norm=target.model.norm.weight.detach().clone(),
        config=target.config,
    )


def tiny_draft(
    target: LlamaForCausalLM, samples: list[dict], draft_vocab_size: int = 200, seed: int = 0
) -> Eagle3DraftModel:
    vocab = select_draft_vocab(count_generated_tokens(samples, target.config.vocab_size), draft_vocab_size)
    return build_draft_from_target(target_head(target), vocab.d2t, vocab.t2d, seed=seed)


def randomize_norms(model: Eagle3DraftModel, seed: int = 1) -> None:
    """Norm weights start at one; make them distinct so a swapped norm shows in the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (
            model.midlayer.input_layernorm,
            model.midlayer.hidden_norm,
            model.midlayer.post_attention_layernorm,
            model.norm,
        ):
            module.weight.copy_(1.0 + 0.5 * torch.randn(module.weight.shape, generator=generator))


def serve_chain(
    model: Eagle3DraftModel,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    last_row: int,
    chain_tokens: list[int],
    position_offset: int = 0,
) -> list[torch.Tensor]:
    """How a server drafts after accepting up to row `last_row`: extend rows 0..last_row, then decode
    one token per step with a KV cache, feeding back the pre-norm state. Returns logits per step (V_d,)."""
    cache = DraftKVCache()
    rows = last_row + 1
    logits, prenorm = model.extend(shift_left(input_ids[None], 1)[:, :rows], aux[None, :rows], 0, cache)
    out = [logits[0, -1]]
    hidden = prenorm[:, -1:]
    for step, token in enumerate(chain_tokens, start=1):
        logits, hidden = model.decode(
            torch.tensor([[token]]), hidden, last_row + step + position_offset, cache
        )
        out.append(logits[0, 0])
    return out


# from tests/chat/test_templates.py
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"


META = json.loads((FIXTURES / "templates.json").read_text())


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]


def fixture_tokenizer(model_dir, name: str):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    meta = META[name]
    tokenizer.add_special_tokens({"additional_special_tokens": meta["special_tokens"]})
    for key in ("bos_token", "eos_token"):
        if meta.get(key) and meta[key] in meta["special_tokens"]:
            setattr(tokenizer, key, meta[key])
    tokenizer.chat_template = (FIXTURES / f"{name}.jinja").read_text()
    return tokenizer


# from tests/generation/test_generation.py
def write_prompts(path: Path, texts: list[str], prefix: str = "p") -> Path:
    with open(path, "w") as handle:
        for index, text in enumerate(texts):
            handle.write(
                json.dumps(
                    {
                        "id": f"{prefix}{index}",
                        "source": "test",
                        "messages": [
                            {"role": "system", "content": "Be brief."},
                            {"role": "user", "content": text},
                        ],
                        "meta": {"n": index},
                    }
                )
                + "\n"
            )
    return path


# from tests/training/test_record.py
CHAIN = Topology.chain(3)


def entry(size: int, variant: str | None = None, converged: bool = True) -> DraftEntry:
    return DraftEntry(
        variant=variant or f"{size} samples",
        size=size,
        topology=CHAIN,
        best_step=8,
        best_accept_length=1.25 + size / 1000,
        best_checkpoint=f"training/size-{size:07d}/best.pt",
        metrics_path=f"training/size-{size:07d}/metrics.jsonl",
        samples_by_dataset={"alpha": size // 2, "beta": size - size // 2},
        schedule="until_converged",
        steps=12,
        step_cap=12,
        samples_seen=48,
        epochs=48 / size,
        converged=converged,
        stopped="converged" if converged else "step_cap",
        improved_step=8,
        recent_gain=None if converged else 0.02,
        recent_window_steps=None if converged else [8, 12],
        recent_evaluations=0 if converged else 2,
        heldout_size=6,
    )


def record() -> SweepRecord:
    return SweepRecord(
        runs=[entry(20), entry(40, converged=False)],
        ablation=[entry(16, "original answers"), entry(16, "regenerated answers")],
        heldout=[("alpha", "a-1"), ("beta", "b-2")],
        topology=CHAIN,
        draft_vocab=DraftVocabRecord(
            size=300, coverage=0.97, counted_tokens=1234, coverage_curve=[[64, 0.5], [300, 1.0]]
        ),
        capture_dir="capture",
        capture_mode="offline",
        capture_layer_ids=[1, 2, 3],
        split_seed=0,
        export={"sglang": "training/export/sglang", "vllm": "training/export/vllm"},
    )


# Tiny random-weight targets of the families the kit must handle, built from transformers' own classes
# and saved in the key layout their real checkpoints use. Vocab 49,152 so the embedded SmolLM2
# tokenizer (copied in) tokenizes for them.
TINY_VOCAB = 49152
_TINY_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
_DEEPSEEK_V3 = dict(
    _TINY_COMMON,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
)
TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _TINY_COMMON),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_TINY_COMMON, head_dim=16)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _TINY_COMMON,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
        ),
    ),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK_V3),
    "kimi_k25": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        _DEEPSEEK_V3,
    ),  # the text model inside the wrapper
}


def tiny_target_folder(family: str, folder: Path, tokenizer_dir: Path | None = None, seed: int = 0) -> Path:
    """Save a tiny `family` target to `folder` and return it.

    Plain families are saved by save_pretrained. `kimi_k25` is a Kimi-K2.5-shaped multimodal wrapper:
    config.json from transformers' Kimi_K25Config (the decoder under `text_config`), the text model's
    tensors under `language_model.model.*` / `language_model.lm_head.weight` and vision tensors beside
    them, as the published checkpoint stores them (transformers' kimi_k25 conversion mapping reads
    exactly these names; its save_pretrained writes `blocks` for `layers`, so it is not used here).
    """
    import transformers
    from safetensors.torch import save_file

    config_name, model_name, fields = TINY_FAMILIES[family]
    torch.manual_seed(seed)
    text_config = getattr(transformers, config_name)(**fields)
    model = getattr(transformers, model_name)(text_config).eval()
    folder = Path(folder)
    if family != "kimi_k25":
        model.save_pretrained(folder)
    else:
        from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

        folder.mkdir(parents=True, exist_ok=True)
        text = {
            key: value
            for key, value in text_config.to_dict().items()
            if key not in ("architectures", "transformers_version")
        }
        config = Kimi_K25Config(
            text_config=text,
            vision_config=dict(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
            ),
        )
        config.architectures = ["KimiK25ForConditionalGeneration"]
        config.save_pretrained(folder)
        tensors = {
            f"language_model.{name}": tensor.contiguous() for name, tensor in model.state_dict().items()
        }
        generator = torch.Generator().manual_seed(seed + 1)
        tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 3, 14, 14, generator=generator)
        tensors["mm_projector.proj.0.weight"] = torch.randn(64, 128, generator=generator)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def fit_draft_on_greedy_answers(
    model_dir: Path,
    questions: list[str],
    max_new_tokens: int,
    steps: int = 40,
    ttt_steps: int = 3,
    draft_vocab_size: int = 512,
    seed: int = 0,
    target=None,
):
    """A draft overfitted on the target's own greedy answers to `questions` (chat-templated), so a real loop
    on the same prompts accepts most drafts: (draft, prompt token lists, full greedy sequences).

    Fits with the kit's TTT unroll (the draft's own forward over `ttt_steps` steps), argmax targets over the
    draft vocab, Adam; a few seconds on CPU for a few short answers. `target`: the loaded target, if the
    caller has it."""
    import torch.nn.functional as F

    from eaglekit.analysis.speculative import greedy_decode
    from eaglekit.draft.model import load_target_head_weights

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = (
        target
        if target is not None
        else LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    )
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for question in questions
    ]
    sequences = [prompt + greedy_decode(target, prompt, max_new_tokens).output_ids for prompt in prompts]
    counts = torch.zeros(target.config.vocab_size, dtype=torch.int64)
    for sequence in sequences:
        counts += torch.bincount(torch.tensor(sequence), minlength=target.config.vocab_size)
    vocab = select_draft_vocab(counts, draft_vocab_size)
    draft = build_draft_from_target(
        load_target_head_weights(model_dir), vocab.d2t, vocab.t2d, seed=seed
    ).train()
    with torch.no_grad():
        features = [
            torch.cat(
                [
                    hidden
                    for index, hidden in enumerate(
                        target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
                    )
                    if index in draft.config.capture_layer_indices
                ],
                dim=-1,
            )
            for sequence in sequences
        ]
    target_to_draft = torch.cumsum(draft.t2d.long(), 0) - 1
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=2e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for sequence, aux, prompt in zip(sequences, features, prompts):
            ids = torch.tensor([sequence])
            for step, logits in enumerate(draft(ids, aux, ttt_steps)):
                rows = slice(len(prompt) - 1, ids.shape[1] - 2 - step)
                loss = loss + F.cross_entropy(
                    logits[0, rows], target_to_draft[ids[0, len(prompt) + 1 + step :]]
                )
        loss.backward()
        optimizer.step()
    return draft.eval(), prompts, sequences


def read_strict_json(path: Path):
    """A JSON file read as strict JSON: NaN and Infinity (which Python's json writes by default) are
    refused."""

    def refuse(constant: str):
        raise ValueError(f"{path}: {constant} is not strict JSON")

    return json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=refuse)


LINE_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) ")  # run.log's timestamp (run_log.RunLogHandler)


def silent_stretches(run_log: Path, limit_s: float) -> list[tuple[str, str, float]]:
    """(line before, line after, seconds) for every gap between consecutive timestamped lines of run.log
    longer than `limit_s` (lines without a timestamp, such as a traceback's, belong to the line before)."""
    stretches, previous, previous_line = [], None, ""
    for line in Path(run_log).read_text(encoding="utf-8", errors="replace").splitlines():
        match = LINE_TIME.match(line)
        if not match:
            continue
        moment = dt.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S")
        if previous is not None and (gap := (moment - previous).total_seconds()) > limit_s:
            stretches.append((previous_line, line, gap))
        previous, previous_line = moment, line
    return stretches
