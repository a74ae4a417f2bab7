"""The EAGLE-3 draft: model, draft vocabulary, SGLang/vLLM export and the checkpoint doctor."""
