"""Stage 6: speculative decoding, acceptance, evaluation, benchmarks, break-even and the scaling answer."""
