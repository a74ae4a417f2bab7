"""The EAGLE-3 draft model: one decoder layer over the target's fused features, read top-down.

What this file matches, and where it was checked (SGLang `python/sglang/srt/models/llama_eagle3.py`,
vLLM `vllm/model_executor/models/llama_eagle3.py`):

- `fc` (H, 3H) fuses the three captured target features. SGLang applies it only when the incoming
  hidden state is wider than the embeddings (the extend pass after verification carries 3H target
  features; draft decode steps carry the draft's own H-wide state), so `fc` runs once per chain.
- The single decoder layer (`midlayer`):
      residual = h                                    # h = fc(features), or the previous draft output
      x = cat(input_layernorm(embed(token)), hidden_norm(h))          # (.., 2H): q/k/v take 2H inputs
      residual = residual + o_proj(attention(x))                      # SGLang's fused add+norm
      residual = residual + mlp(post_attention_layernorm(residual))
  The residual is `h` itself, not `hidden_norm(h)` (vLLM's default `norm_before_residual=False`; its
  speculators-format loader defaults that flag to True, so the vLLM export writes False explicitly).
- `norm` then `lm_head` give logits over the draft vocab; the state *before* `norm` (SGLang's
  `hidden_states_to_aux`, vLLM's `hidden_prenorm`) is what the next draft step receives as `h`.
- Draft logits index the draft vocab; draft id d means target id d + d2t[d] (SGLang `hot_token_id`,
  vLLM `draft_id_to_target_id`).
- Positions (DESIGN "EAGLE-3 facts"): row t of an extend carries the target features of position t
  and the token at t+1, with RoPE position t. Draft decode step j (j = 1, 2, ...) after an extend whose
  last row has position p uses position p + j (SGLang since May 2026).
- Training-time test (TTT) reproduces that serving pattern for every row at once: at TTT step i the
  row t stands for "decode step i after an extend ending at row t", so it uses position t + i, sees the
  step-0 keys of rows 0..t (causal) plus its own keys of steps 1..i, and nothing else.
  `TrainingTimeTestKeyValues` does this; `DraftKVCache` is the plain server-style cache; a test checks
  both give the same logits.

The target's `embed_tokens` is loaded and frozen: the draft embeds tokens with the target's table,
which SGLang and vLLM share from the target at serving time, so it is never exported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

# DRAFT_SHAPES, draft_shape, rope_parameters_of: not used here, part of this module's API.
from eaglekit.draft.config import (  # noqa: F401
    DRAFT_SHAPES,
    DraftConfig,
    DraftShape,
    TargetTextConfig,
    draft_shape,
    rope_parameters_of,
)
from eaglekit.draft.head_loss import HeadTeacher, chunked_soft_cross_entropy

if TYPE_CHECKING:
    from eaglekit.target import TargetLayout

class RMSNorm(nn.Module):
    """Llama RMSNorm: normalize in float32, scale by a learned weight. (.., H) -> (.., H)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden_states.to(input_dtype)


class DraftKVCache:
    """Server-style KV cache: keys of every row the draft has processed, in order.

    An extend appends n rows that attend causally among themselves and to everything before; a decode
    step appends one row that attends to everything. This is the reference the TTT attention must equal.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # (B, KV, L, D)
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """query (B, Hq, n, D), key/value (B, KV, n, D) -> (B, Hq, n, D)."""
        past = self.length
        self.keys = key if self.keys is None else torch.cat([self.keys, key], dim=2)
        self.values = value if self.values is None else torch.cat([self.values, value], dim=2)
        groups = query.shape[1] // key.shape[1]
        keys, values = repeat_kv(self.keys, groups), repeat_kv(self.values, groups)
        scores = (query @ keys.transpose(-1, -2)) * scale  # (B, Hq, n, L)
        new_rows = torch.arange(query.shape[2], device=query.device)[:, None] + past
        visible = torch.arange(keys.shape[2], device=query.device)[None, :] <= new_rows  # (n, L)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        return probs @ values


def attend_prefix_and_steps(query: torch.Tensor, prefix_keys: torch.Tensor, prefix_values: torch.Tensor,
                            visible: torch.Tensor, step_keys: list[torch.Tensor], step_values: list[torch.Tensor],
                            scale: float) -> torch.Tensor:
    """Attention over a masked prefix plus one key per later step, each row's own (TTT's steps, a tree's
    ancestors).

    query (B, Hq, T, D); prefix keys/values (B, KV, L, D) with `visible` (T, L); step keys/values each
    (B, KV, T, D). A later step's score is an elementwise dot product, not a (T x T) product per step.
    """
    groups = query.shape[1] // prefix_keys.shape[1]
    prefix_keys, prefix_values = repeat_kv(prefix_keys, groups), repeat_kv(prefix_values, groups)
    # (B, Hq, T, L)
    prefix_scores = ((query @ prefix_keys.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
    # each (B, Hq, T, 1)
    step_scores = [(query * repeat_kv(keys, groups)).sum(-1, keepdim=True) * scale for keys in step_keys]
    probs = torch.softmax(torch.cat([prefix_scores, *step_scores], dim=-1).float(), dim=-1).to(query.dtype)
    length = prefix_keys.shape[2]
    output = probs[..., :length] @ prefix_values
    for offset, values in enumerate(step_values):
        output = output + probs[..., length + offset : length + offset + 1] * repeat_kv(values, groups)
    return output


class TrainingTimeTestKeyValues:
    """Keys of every TTT step so far, attended the way serving will attend them.

    Step 0 holds the extend rows (row t attends rows 0..t of its own document). At step i >= 1 row t
    plays decode step i of a chain started at row t, so it sees step-0 rows 0..t of its document plus
    its *own* keys from steps 1..i (the same row t of each step) -- a causal block plus i diagonals,
    never other rows' later steps. Cost is O(T^2 + i T) per step instead of recomputing the chain.

    document_ids (B, T): a packed row holds several samples; a row attends only to rows of the same
    document (block-diagonal causal mask), so packing never lets one sample see another.

    Two backends compute the same thing:
    - "eager": scores against step-0 keys as a dense (B, Hq, T, T) matrix plus one elementwise score
      per later step. Works everywhere (CPU training and every test); memory grows with T^2.
    - "flex": one `flex_attention` call per step over the concatenated keys of steps 0..i with a block
      mask (document-causal on step 0, the diagonal on later steps), compiled. No T^2 scores are
      stored; the kernel skips blocks no row sees. For CUDA (flex attention has no CPU backward).
    """

    def __init__(self, document_ids: torch.Tensor | None = None, backend: str = "eager") -> None:
        if backend not in ("eager", "flex"):
            raise ValueError(f"attention backend {backend!r}: use 'eager' or 'flex'")
        self.keys: list[torch.Tensor] = []  # per step (B, KV, T, D)
        self.values: list[torch.Tensor] = []
        self.document_ids = document_ids
        self.backend = backend
        self._visible: torch.Tensor | None = None  # (B, 1, T, T) bool, built once per unroll

    def _step0_visible(self, length: int, device: torch.device) -> torch.Tensor:
        if self._visible is None:
            visible = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
            if self.document_ids is not None:
                same_document = self.document_ids[:, None, :, None] == self.document_ids[:, None, None, :]
                visible = visible & same_document
            self._visible = visible
        return self._visible

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """query (B, Hq, T, D), key/value (B, KV, T, D) -> (B, Hq, T, D)."""
        self.keys.append(key)
        self.values.append(value)
        if self.backend == "flex":
            return self._attend_flex(query, scale)
        # Step 0's keys under the causal (and packing) mask; row t's own keys from the later steps.
        return attend_prefix_and_steps(query, self.keys[0], self.values[0], self._step0_visible(query.shape[2], query.device),
                                       self.keys[1:], self.values[1:], scale)

    def _attend_flex(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        batch, _, length, _ = query.shape
        keys, values = torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)  # (B, KV, (i+1) T, D)
        if query.device.type == "meta":  # a memory dry run (eaglekit.training.memory): no mask to build
            return flex_attention_kernel(query.device)(query, keys, values)
        block_mask = ttt_block_mask(self.document_ids, batch, length, len(self.keys), query.device)
        return flex_attention_kernel(query.device)(query, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)


def ttt_mask_mod(document_ids: torch.Tensor | None, length: int):
    """flex_attention mask over keys [step 0 | step 1 | ... | step i] (each T long) for query row q.

    Step-0 key kv is visible when kv <= q in the same document; key kv of a later step is visible
    only when it is row q's own (kv mod T == q).
    """

    def mask_mod(batch, head, query_index, key_index):
        row = key_index % length
        same_document = True if document_ids is None else document_ids[batch, query_index] == document_ids[batch, row]
        step0 = (key_index < length) & (row <= query_index) & same_document
        own_later = (key_index >= length) & (row == query_index)
        return step0 | own_later

    return mask_mod


def ttt_block_mask(document_ids: torch.Tensor | None, batch: int, length: int, steps: int, device: torch.device):
    """The BlockMask of TTT step `steps - 1`: queries (T) against the keys of `steps` steps."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(ttt_mask_mod(document_ids, length), batch if document_ids is not None else None, None,
                             length, steps * length, device=device)


_COMPILED_FLEX: dict[str, object] = {}


class _FlexMemoryStandIn(torch.autograd.Function):
    """Shape-only stand-in for flex_attention on the meta device: keeps for backward what the fused
    kernel keeps (query, keys, values, output, logsumexp), so eaglekit.training.memory can count a
    flex step's activations with a dry run (flex attention itself does not run on meta tensors)."""

    @staticmethod
    def forward(ctx, query, keys, values):
        output = torch.empty_like(query)
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, keys, values, output, logsumexp)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError("a memory stand-in: dry runs only")


def flex_attention_kernel(device: torch.device):
    """flex_attention, compiled where it has a fused kernel (CUDA); eager elsewhere (forward only on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "meta":
        return lambda query, keys, values, **_: _FlexMemoryStandIn.apply(query, keys, values)
    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED_FLEX:
        # packs: one shape; padded batches: dynamic after a recompile
        _COMPILED_FLEX["cuda"] = torch.compile(flex_attention)
    return _COMPILED_FLEX["cuda"]


KeyValues = DraftKVCache | TrainingTimeTestKeyValues


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide cat(embed, hidden); o_proj writes H."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.q_proj = nn.Linear(2 * config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_values: KeyValues) -> torch.Tensor:
        """(B, T, 2H) -> (B, T, H)."""
        batch, length, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(hidden_states).view(batch, length, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(hidden_states).view(batch, length, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        attended = key_values.attend(query, key, value, self.scale)  # (B, Hq, T, D)
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)). (.., H) -> (.., H)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; the EAGLE-3 Llama draft uses 'silu'")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class Eagle3DecoderLayer(nn.Module):
    """The one draft layer. Names match SGLang's `midlayer.*` tensors exactly."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def forward(
        self, input_embeds: torch.Tensor, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_values: KeyValues
    ) -> torch.Tensor:
        """input_embeds (B, T, H), hidden_states (B, T, H) -> pre-norm output (B, T, H)."""
        residual = hidden_states  # SGLang/vLLM: the residual is h itself, not hidden_norm(h)
        attention_input = torch.cat([self.input_layernorm(input_embeds), self.hidden_norm(hidden_states)], dim=-1)
        residual = residual + self.self_attn(attention_input, cos, sin, key_values)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class DraftHead(nn.Linear):
    """lm_head over the draft vocab (Vd, H). Called with a `HeadTeacher` it returns the chunked soft
    cross-entropy (eaglekit.draft.head_loss) instead of logits: the loss runs inside this module's forward,
    so FSDP's unshard hooks cover the weight it reads."""

    def forward(self, hidden_states: torch.Tensor, teacher: HeadTeacher | None = None):  # type: ignore[override]
        if teacher is None:
            return super().forward(hidden_states)  # (.., H) -> (.., Vd)
        return chunked_soft_cross_entropy(hidden_states, self.weight, teacher.probs, teacher.rows, teacher.row_weights, teacher.chunk_rows)


class Eagle3DraftModel(nn.Module):
    """EAGLE-3 draft: frozen target embeddings, fc, one layer, norm, lm_head over the draft vocab.

    Four hooks, as the training loop sees them: `embed`, `project_features`, `step` (backbone), `logits`.
    `forward` is the training-time-test unroll; `DraftKVCache` + `step` is how a server runs it.
    """

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's table, shared at serving time
        self.fc = nn.Linear(3 * config.hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = DraftHead(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.to_llama_config())
        # d2t[d] = target_id - d; t2d[target_id] = is that token in the draft vocab. Set by set_draft_vocab.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        # TTT attention: "auto" (flex on CUDA, eager on CPU), "eager" or "flex". Not a weight, not exported.
        self.attention_backend = "auto"
        self._init_trainable_weights()

    def _init_trainable_weights(self) -> None:
        # Llama's initializer: normal(0, 0.02) for linear layers; norms start at one.
        for module in (self.fc, self.midlayer.self_attn, self.midlayer.mlp, self.lm_head):
            for parameter in module.parameters():
                nn.init.normal_(parameter, mean=0.0, std=0.02)

    # -- the four hooks ----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, H) with the target's frozen table."""
        return self.embed_tokens(input_ids)

    def project_features(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """Fuse the three target features: (B, T, 3H) -> (B, T, H)."""
        dtype = self.fc.weight.dtype
        if aux_hidden_states.is_cuda and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")  # bf16 features stay bf16: no fp32 copy of (T, 3H)
        return self.fc(aux_hidden_states.to(dtype))

    def step(
        self, input_ids: torch.Tensor, hidden_states: torch.Tensor, position_ids: torch.Tensor, key_values: KeyValues
    ) -> torch.Tensor:
        """One draft forward: tokens (B, T), h (B, T, H), positions (B, T) -> pre-norm output (B, T, H)."""
        input_embeds = self.embed(input_ids).to(hidden_states.dtype)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        return self.midlayer(input_embeds, hidden_states, cos, sin, key_values)

    def logits(self, prenorm_hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, draft_vocab): logits over draft ids."""
        return self.lm_head(self.norm(prenorm_hidden_states))

    # -- training-time test --------------------------------------------------------------------------
    def resolved_attention_backend(self, device: torch.device) -> str:
        """"auto": flex when training on CUDA; eager on CPU (flex attention has no CPU backward) and
        without gradients (held-out evaluation: variable padded lengths would recompile the kernel)."""
        if self.attention_backend == "auto":
            return "flex" if device.type == "cuda" and torch.is_grad_enabled() else "eager"
        return self.attention_backend

    def unroll(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        ttt_steps: int,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """The TTT unroll's pre-norm states: ttt_steps tensors (B, T, H) (see `forward`)."""
        batch, length = input_ids.shape
        key_values = TrainingTimeTestKeyValues(document_ids, self.resolved_attention_backend(input_ids.device))
        hidden_states = self.project_features(aux_hidden_states)
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        step_states = []
        for ttt_step in range(ttt_steps):
            step_tokens = shift_left(input_ids, 1 + ttt_step, document_ids=document_ids)
            hidden_states = self.step(step_tokens, hidden_states, position_ids + ttt_step, key_values)
            step_states.append(hidden_states)
        return step_states

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        ttt_steps: int,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        return_normed_states: bool = False,
    ) -> list[torch.Tensor]:
        """Unroll the draft on its own output states for `ttt_steps` steps.

        input_ids (B, T): the sample's tokens; aux_hidden_states (B, T, 3H): target features per position.
        Step i, row t: token input_ids[t+1+i], RoPE position t+i, h = fc(features[t]) at step 0 else the
        previous step's pre-norm output of row t; it predicts the token at t+2+i.
        A packed row (several samples) passes position_ids (B, T), each sample's own positions from 0,
        and document_ids (B, T): tokens, positions and attention then never cross a sample boundary,
        so every sample's logits equal those of the sample alone.
        Returns ttt_steps logits tensors (B, T, draft_vocab), or with return_normed_states the head's
        inputs norm(h) (B, T, H): training runs the head chunk by chunk (`lm_head(states, teacher)`,
        eaglekit.draft.head_loss) and never holds all logits. Rows whose tokens run past the end of their
        sample are padding (token 0) and must be masked by the caller.
        """
        step_states = self.unroll(input_ids, aux_hidden_states, ttt_steps, position_ids, document_ids)
        if return_normed_states:
            return [self.norm(hidden_states) for hidden_states in step_states]
        return [self.logits(hidden_states) for hidden_states in step_states]

    # -- serving-style decoding (the reference the unroll must equal) -------------------------------
    def extend(
        self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, start_position: int, cache: DraftKVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend rows: tokens (B, n) already shifted (row t holds token t+1), features (B, n, 3H).

        Returns (logits (B, n, draft_vocab), pre-norm states (B, n, H)) and appends n rows to `cache`.
        """
        batch, length = input_ids.shape
        positions = torch.arange(start_position, start_position + length, device=input_ids.device).expand(batch, length)
        prenorm = self.step(input_ids, self.project_features(aux_hidden_states), positions, cache)
        return self.logits(prenorm), prenorm

    def decode(
        self, input_ids: torch.Tensor, hidden_states: torch.Tensor, position: int, cache: DraftKVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft decode step: token (B, 1), previous pre-norm state (B, 1, H), RoPE position.

        Returns (logits (B, 1, draft_vocab), pre-norm state (B, 1, H)).
        """
        positions = torch.full_like(input_ids, position)
        prenorm = self.step(input_ids, hidden_states, positions, cache)
        return self.logits(prenorm), prenorm

    # -- vocab and weights --------------------------------------------------------------------------
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocab mapping: d2t int64 (draft_vocab,), t2d bool (vocab,)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit draft_vocab "
                             f"{self.config.draft_vocab_size} / vocab {self.config.vocab_size}")
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def draft_to_target_ids(self) -> torch.Tensor:
        """(draft_vocab,) target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embeddings: what checkpoints and exports carry."""
        return {name: tensor for name, tensor in self.state_dict().items() if not name.startswith("embed_tokens.")}


def shift_left(input_ids: torch.Tensor, shift: int, fill: int = 0, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Row t gets input_ids[t + shift]; rows past the end (or, packed, past their document) get `fill`.

    (B, T) -> (B, T); document_ids (B, T) marks each packed sample.
    """
    shifted = torch.full_like(input_ids, fill)
    length = input_ids.shape[1]
    if shift < length:
        shifted[:, : length - shift] = input_ids[:, shift:]
        if document_ids is not None:
            crosses = document_ids[:, shift:] != document_ids[:, : length - shift]
            shifted[:, : length - shift] = shifted[:, : length - shift].masked_fill(crosses, fill)
    return shifted


@dataclass
class TargetHeadWeights:
    """The target weights the draft borrows: embeddings (V, H), lm_head (V, H), final norm (H,), and the
    text decoder's config as the draft needs it (`TargetTextConfig`; a transformers config or a config
    dict is accepted too, as tests build them from live models)."""

    embed_tokens: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    config: Any


def load_target_head_weights(target: "str | Path | TargetLayout", trust_remote_code: bool = False) -> TargetHeadWeights:
    """Read only embed_tokens, lm_head and the final norm of a target checkpoint (no model load).

    `target` is a TargetLayout or a folder (resolved through `eaglekit.target.target_layout`, remote code
    passed). Tensor names come from the layout: `model.embed_tokens.weight` for a causal LM,
    `language_model.model.embed_tokens.weight` / `language_model.lm_head.weight` for Kimi-K2.5's wrapper.
    A tied text model (SmolLM2) has no lm_head tensor: its lm_head is the embedding table.
    """
    from eaglekit.target import target_layout

    layout = target if hasattr(target, "read_tensors") else target_layout(target, trust_remote_code=trust_remote_code)
    tied = layout.tie_word_embeddings or layout.lm_head_name not in layout.weight_map()
    names = [layout.embed_tokens_name, layout.final_norm_name] + ([] if tied else [layout.lm_head_name])
    tensors = layout.read_tensors(names)
    config = TargetTextConfig.of(layout)
    embed_tokens = tensors[layout.embed_tokens_name]
    if tuple(embed_tokens.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"{layout.folder}: {layout.embed_tokens_name} is {tuple(embed_tokens.shape)}, but its config says "
                         f"(vocab_size, hidden_size) = {(config.vocab_size, config.hidden_size)}: config.json and the weights "
                         "are of different models")
    return TargetHeadWeights(embed_tokens=embed_tokens, lm_head=embed_tokens if tied else tensors[layout.lm_head_name],
                             final_norm=tensors[layout.final_norm_name], config=config)


def build_draft_from_target(
    target: TargetHeadWeights,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    capture_layer_indices: tuple[int, int, int] | None = None,
    seed: int = 0,
    shape: DraftShape | str | None = None,
) -> Eagle3DraftModel:
    """A fresh draft for `target`: frozen target embeddings, lm_head = target lm_head rows of the draft
    vocab, norm = target final norm (both speed convergence on small data), the rest random (seeded).
    `shape`: a DraftShape or a name in DRAFT_SHAPES (default: derived from the target)."""
    config = DraftConfig.from_target_config(target.config, draft_vocab_size=int(d2t.shape[0]), capture_layer_indices=capture_layer_indices,
                                            shape=shape)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    model.set_draft_vocab(d2t, t2d)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embed_tokens.float())
        model.lm_head.weight.copy_(target.lm_head.float()[model.draft_to_target_ids()])
        model.norm.weight.copy_(target.final_norm.float())
    return model
