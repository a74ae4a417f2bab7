"""The EAGLE-3 draft: model, draft vocabulary, the checkpoint's tensor table, SGLang/vLLM export and the
doctor.

The model's public names are re-exported here (`from eaglekit.draft import Eagle3DraftModel`); the
vocab, export and doctor live in their modules (`eaglekit.draft.vocab`, `.export`, `.doctor`).
"""

from eaglekit.draft.model import (
    DRAFT_SHAPES,
    DraftConfig,
    DraftShape,
    DraftHead,
    DraftKVCache,
    Eagle3Attention,
    Eagle3DecoderLayer,
    Eagle3DraftModel,
    Eagle3MLP,
    RMSNorm,
    TargetHeadWeights,
    TargetTextConfig,
    TrainingTimeTestKeyValues,
    build_draft_from_target,
    draft_shape,
    flex_attention_kernel,
    load_target_head_weights,
    shift_left,
    ttt_block_mask,
    ttt_mask_mod,
)
