"""Capture through SGLang's in-process model runner (SGLang 0.5.23, pinned) under torchrun as one TP group.

Every torchrun rank builds SGLang's `ModelRunner` for its TP rank, as `sglang.benchmark.one_batch.load_model`
does in 0.5.23 (`ModelConfig.from_server_args`, `bootstrap.init_parallel_runtime`, `ModelRunner`,
`alloc_memory_pool`, `init_attention_backends`; SpecForge's `sglang.bench_one_batch` import is gone in
0.5.23). The aux layers are set through SGLang's EAGLE-3 capture hook: with
`enable_return_aux_hidden_states` + `speculative_algorithm="EAGLE3"` the runner calls
`model.set_eagle3_layers_to_capture(ids)`, which captures the input of layer `id + 1`, so we pass our
`output_hidden_states` indices minus one. A FULL-capture extend then returns, per token,
`logits_output.hidden_states` = the aux layers concatenated (T, 3H) and `last_hidden_states` = the final
norm's output (T, H): the kit's shard format. All ranks run every batch; TP rank 0 writes the shards
(`capture_to_shards` with `tensor_parallel_rank`).

Written from SGLang 0.5.23's source (sglang/benchmark/one_batch.py, srt/layers/logits_processor.py,
srt/arg_groups/fields/exec_.py); it needs CUDA and has not run on this CPU machine. Run it as
`SGLANG_COMMAND` (tests/capture/test_sglang_capture.py is marked gpu).
"""

from __future__ import annotations

import argparse
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eaglekit.capture.inputs import TokenizedSample
from eaglekit.capture.shards import CapturedSample

SGLANG_VERSION = "0.5.23"
SGLANG_COMMAND = ("torchrun --nproc-per-node <capture.tensor_parallel> -m eaglekit.capture.sglang_capture "
                  "--params <params.yaml> --run-dir <outputs/run_id>")


def check_sglang_version() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("sglang")
    except PackageNotFoundError:
        raise RuntimeError(f"capture.engine sglang needs SGLang {SGLANG_VERSION}: `pip install sglang=={SGLANG_VERSION}`") from None
    if installed != SGLANG_VERSION:
        raise RuntimeError(f"capture.engine sglang is written against SGLang {SGLANG_VERSION} (its model runner's entry points "
                           f"moved between releases); this environment has {installed}: `pip install sglang=={SGLANG_VERSION}`")


def sglang_layer_ids(capture_layer_ids: Sequence[int]) -> list[int]:
    """SGLang's EAGLE-3 hook captures the input of layer id + 1: our output_hidden_states
    indices minus one."""
    return [int(layer_id) - 1 for layer_id in capture_layer_ids]


@dataclass
class SglangCapture:
    """SGLang's ModelRunner on this TP rank as capture's FeatureSource."""

    model_runner: Any
    capture_layer_ids: list[int]
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    dtype_name: str
    tensor_parallel_rank: int

    @classmethod
    def start(cls, model_dir: str, capture_layer_ids: Sequence[int], tensor_parallel: int, tensor_parallel_rank: int, gpu_id: int,
              dtype: str, trust_remote_code: bool, nccl_port: int, mem_fraction_static: float = 0.8,
              extra_server_args: dict | None = None) -> "SglangCapture":
        check_sglang_version()
        from sglang.benchmark.one_batch import _init_process_global_configs, load_model
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
        from sglang.srt.server_args import PortArgs, ServerArgs

        server_args = ServerArgs(model_path=str(model_dir), tp_size=tensor_parallel, dtype=dtype, trust_remote_code=trust_remote_code,
                                 mem_fraction_static=mem_fraction_static, nccl_port=nccl_port, disable_cuda_graph=True,
                                 enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                                 return_aux_hidden_state_layer_ids=sglang_layer_ids(capture_layer_ids), **(extra_server_args or {}))
        server_args.resolve_once()
        _set_envs_and_config(server_args)
        port_args = PortArgs.init_new(server_args)  # nccl_port is the one given: the same on every rank
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=tensor_parallel_rank,
                                                                                             pp_rank=0), gpu_id=gpu_id))
        _init_process_global_configs()
        bench_runner, _ = load_model(server_args, port_args, gpu_id, tensor_parallel_rank)
        model_runner = getattr(bench_runner, "model_runner", bench_runner)
        config = model_runner.model_config.hf_text_config
        return cls(model_runner=model_runner, capture_layer_ids=list(capture_layer_ids), hidden_size=int(config.hidden_size),
                   num_hidden_layers=int(config.num_hidden_layers), vocab_size=int(config.vocab_size), dtype_name=dtype,
                   tensor_parallel_rank=tensor_parallel_rank)

    def _extend(self, samples: Sequence[TokenizedSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """One prefill of the batch with FULL hidden-state capture: aux (sum T, 3H), final (sum
        T, H) on the GPU."""
        from sglang.benchmark.one_batch import TreeCacheNamespace, _maybe_prepare_mlp_sync_batch
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.model_runner
        requests = []
        for number, sample in enumerate(samples):
            request = Req(rid=str(number), origin_input_text="", origin_input_ids=array("q", sample.input_ids),
                          sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
            request.full_untruncated_fill_ids = request.origin_input_ids
            request.logprob_start_len = -1
            request.extend_end = len(request.origin_input_ids)
            requests.append(request)
        tree_cache = TreeCacheNamespace(page_size=get_schedule().page_size, device=runner.device,
                                        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator)
        batch = ScheduleBatch.init_new(reqs=requests, req_to_token_pool=runner.req_to_token_pool,
                                       token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=tree_cache,
                                       model_config=runner.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        _maybe_prepare_mlp_sync_batch(batch, runner)
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
        forward_batch = ForwardBatch.init_new(batch, runner, return_hidden_states_before_norm=False)
        forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
        output = runner.forward(forward_batch).logits_output
        aux, final = output.hidden_states, output.last_hidden_states
        # Free the batch's KV slots: every batch is a fresh prefill.
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        return aux, final

    def capture_batches(self, batches: Iterable[Sequence[TokenizedSample]],
                        capture_layer_ids: Sequence[int]) -> Iterator[list[CapturedSample]]:
        if list(capture_layer_ids) != self.capture_layer_ids:
            raise ValueError(f"the SGLang runner captures layers {self.capture_layer_ids}, capture asked for {list(capture_layer_ids)}")
        for samples in batches:
            with torch.inference_mode():
                aux, final = self._extend(samples)
            lengths = [len(sample.input_ids) for sample in samples]
            if aux is None or final is None or aux.shape != (sum(lengths), 3 * self.hidden_size) \
                    or final.shape != (sum(lengths), self.hidden_size):
                raise RuntimeError(f"SGLang returned aux {None if aux is None else tuple(aux.shape)} and final "
                                   f"{None if final is None else tuple(final.shape)} for {sum(lengths)} tokens of samples "
                                   f"{[f'{s.dataset}/{s.id}' for s in samples][:3]}: expected (T, 3H) and (T, H)")
            aux, final = aux.to(torch.bfloat16).cpu(), final.to(torch.bfloat16).cpu()
            yield [CapturedSample.of(sample, sample_aux, sample_final)
                   for sample, sample_aux, sample_final in zip(samples, aux.split(lengths), final.split(lengths), strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    """`torchrun --nproc-per-node TP -m eaglekit.capture.sglang_capture --params P --run-dir D`: stage 4's
    shards via SGLang."""
    from pathlib import Path

    from eaglekit.capture.layers import resolve_capture_layer_ids
    from eaglekit.capture.run import capture_samples
    from eaglekit.config import load_params
    from eaglekit.run_folder import stage_dir, tokenized_data_files
    from eaglekit.target import resolve_model, target_layout

    parser = argparse.ArgumentParser(prog="python -m eaglekit.capture.sglang_capture")
    parser.add_argument("--params", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--nccl-port", type=int, default=int(os.environ.get("MASTER_PORT", "29500")) + 1)
    arguments = parser.parse_args(argv)
    params = load_params(arguments.params)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != params.capture.tensor_parallel:
        parser.error(f"torchrun started {world_size} processes but capture.tensor_parallel is {params.capture.tensor_parallel}")
    layout = target_layout(resolve_model(params.target.model, revision=params.target.revision), params.target.trust_remote_code)
    capture_layer_ids = resolve_capture_layer_ids(params.target.capture_layers or None, layout.num_hidden_layers)
    source = SglangCapture.start(str(layout.folder), capture_layer_ids, world_size, rank, int(os.environ.get("LOCAL_RANK", "0")),
                                 params.target.dtype, params.target.trust_remote_code, arguments.nccl_port)
    run_dir = Path(arguments.run_dir)
    report = capture_samples(params, source, tokenized_data_files(run_dir), stage_dir(run_dir, "capture"), capture_layer_ids,
                             progress=rank == 0)
    if rank == 0:
        print(f"SGLang capture: {report.captured_samples} samples, {report.captured_tokens:,} tokens, {report.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
