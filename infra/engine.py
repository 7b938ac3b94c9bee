"""The vLLM engine: made for the hardware, its weights synced from the trainer, asleep while it trains.

Every vLLM-specific detail the project relies on lives here, one named function each, written
against vllm 0.32 (what each does and why is in its docstring):
- make_engine: bf16 with sleep mode on GPUs; fp32, eager, a KV cache sized in tokens on CPUs; in
  process (its tensors are handed over as tensors); vLLM's V1 model runner on GPUs as on CPUs (the
  runner every test runs); a seed of its own per rank (engine_seed); with random weights (vLLM's
  dummy load format) when the trainer syncs its own before the first rollout, so no rank reads the
  checkpoint twice.
- sync_weights: the trainer's weights (full_weights: each FSDP2 shard cast to the engine's dtype, then
  gathered, one parameter at a time) loaded in place (`reload_weights`), the prefix cache reset.
- sleep / wake_for_rollout: the engine's GPU memory given to training (level 2: the weights dropped,
  as the next sync overwrites every one of them) and taken back. The mirror image, the trainer's
  state in host memory while the engine rolls out, is the trainer's: infra/offload.py.
- kv_capacity_tokens, kv_block_tokens: how many tokens the engine's KV cache holds, and per block.
- model_eos_ids, turn_tokens: where vLLM ends a turn on its own, and a finished turn's ids and log-probs.
- shutdown: the engine stopped at the end of a run, leaving torch.distributed to the trainer.
On a GPU a step cycles: rollout (awake) -> sleep (weights and KV cache dropped) -> training ->
sync_weights (the weights woken and written, nothing else) -> wake_for_rollout (the KV cache).
"""
import os


def kv_bytes_per_token(model: str, dtype_bytes: int) -> int:
    """KV-cache bytes one token takes in every layer: keys and values, each KV heads x head size."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def engine_dtype(device):
    """The engine's dtype, which every sync casts to: bf16 on GPUs, fp32 on CPUs (vLLM 0.32's CPU
    attention in bf16 would make the trainer's fp32 log-probs differ from the sampler's)."""
    import torch
    return torch.bfloat16 if device.type == "cuda" else torch.float32


CPU_KV_CACHE_TOKENS = 65536  # the CPU default: 256 MB for the toy model, 3 GB for a 135M Llama
CPU_BLOCK = 128              # tokens per KV-cache block (vLLM 0.32's CPU default)


def add_engine_flags(group, memory_fraction) -> None:
    """The engine's memory, one definition for train.py, eval.py and chat.py, each with its default
    share of a GPU (train.py's "auto": the memory plan's)."""
    group.add_argument("--memory-fraction", default=memory_fraction,
                       help="GPUs: the engine's share of GPU memory (weights + KV cache)")
    group.add_argument("--kv-cache-tokens", type=int, default=None,
                       help=f"CPUs: the engine's KV cache in tokens (default {CPU_KV_CACHE_TOKENS})")


def engine_seed(seed: int, rank: int) -> int:
    """The engine seed of a rank. vLLM seeds Python's, numpy's and torch's generators with it
    (vllm/utils/torch_utils.py set_random_seed), and requests without a seed of their own draw their
    noise from those: V1 from torch's (v1/sample/ops/topk_topp_sampler.py random_sample, forward_cpu), V2
    a per-request seed from numpy's (v1/worker/gpu/sample/states.py). Under torchrun every rank's engine
    is a data-parallel index 0 (config/parallel.py), so one seed for all would give the k-th request of
    every rank the same noise. Rank 0 keeps `seed` (a one-rank run is unchanged); the others derive
    theirs as vLLM does for its own data-parallel engines (torch_utils.py set_random_seed)."""
    if rank == 0:
        return seed
    import numpy as np
    return int(np.random.SeedSequence((seed, rank)).generate_state(1)[0])


def make_engine(model: str, max_model_len: int, seed: int = 0, memory_fraction: float | None = None,
                kv_cache_tokens: int | None = None, external_launcher: bool = False, weights: bool = True,
                rank: int | None = None):
    """The vLLM engine for this hardware. GPUs: bf16, sleep mode, `memory_fraction` of the GPU for
    weights and KV cache (default 0.5). CPUs: fp32, eager mode, a KV cache of `kv_cache_tokens` tokens.
    (vLLM 0.32 on CPU turns a fraction into fraction x the NUMA node's memory minus this process's RSS,
    which is negative on a machine with an 11 GB node: the cache is sized in bytes.) weights=False: the
    weights are random until the first sync_weights (the checkpoint is not read: 8 x 29.5 GB at 14B).
    rank: whose engine seed (engine_seed); default torchrun's RANK, else 0."""
    # In-process engine core: weights are handed over as tensors (sync_weights) and its sleeping tags
    # read in process (_sleeping); a multiprocess core can do neither (the iterator is not picklable).
    if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise RuntimeError("VLLM_ENABLE_V1_MULTIPROCESSING=1 asks for an engine in another process, which "
                           "cannot take the trainer's weights as tensors nor say what sleeps\n---> HINT: "
                           "unset it (or set it to 0): every engine here runs in its rank's process")
    # vLLM 0.32 runs its Model Runner V2 on GPUs and V1 where Triton is missing, as on CPUs
    # (config/vllm.py use_v2_model_runner): sampling, log-probs, sleep and reload_weights are tested on
    # V1, so GPUs run V1 too. VLLM_USE_V2_MODEL_RUNNER=1 asks for V2 (docs/gpu.md).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    import torch
    from vllm import LLM
    # The sampler reports log-probs of the distribution it drew from (after temperature), the
    # distribution the trainer scores (logprobs.token_logprobs divides by the same temperature).
    kwargs = dict(model=model, seed=engine_seed(seed, rank), max_model_len=max_model_len,
                  enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                  load_format="auto" if weights else "dummy")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = str(engine_dtype(device)).removeprefix("torch.")
    if device.type == "cuda":
        share = float(memory_fraction or 0.5)  # (a flag's string, or the memory plan's number)
        kwargs.update(dtype=dtype, enable_sleep_mode=True, gpu_memory_utilization=share)
    else:  # CPU: eager mode starts without torch.compile's warm-up. A prompt split by
        # chunked prefill makes vllm 0.32 rewind the request's seeded generator, which CPU generators
        # cannot do ("CPU Generator does not use offset"): prefill prompts whole.
        kv_cache_tokens = kv_cache_tokens or CPU_KV_CACHE_TOKENS
        blocks = -(-kv_cache_tokens // CPU_BLOCK) + 1  # whole blocks, and the null block vLLM sets aside
        kwargs.update(dtype=dtype, enforce_eager=True, enable_chunked_prefill=False,
                      max_num_batched_tokens=max(max_model_len, 8192), block_size=CPU_BLOCK,
                      kv_cache_memory_bytes=blocks * CPU_BLOCK * kv_bytes_per_token(model, dtype_bytes=4))
    if external_launcher:  # under torchrun: one engine per rank, inside the ranks' process group
        kwargs["distributed_executor_backend"] = "external_launcher"
    try:
        return LLM(**kwargs)
    except ValueError as e:
        if "kv_cache_memory_bytes" not in kwargs or "memory" not in str(e):
            raise
        gib = kwargs["kv_cache_memory_bytes"] / 2**30
        raise RuntimeError(f"{e}\n---> HINT: a KV cache of {kv_cache_tokens} tokens ({gib:.2f} GiB) does not "
                           f"fit in this machine's free memory: ask for fewer (--kv-cache-tokens) or free "
                           f"some memory") from None


def model_eos_ids(model: str) -> tuple[int, ...]:
    """The model's end-of-sequence ids, from its generation_config.json (else config.json). vLLM stops a
    request at them whatever its stop ids say: Qwen3 base models end a turn with <|endoftext|>."""
    from transformers import AutoConfig, GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json
        eos = AutoConfig.from_pretrained(model).eos_token_id
    return tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)


def turn_tokens(output) -> tuple[list[int], list[float]]:
    """Token ids and their log-probs from a vLLM CompletionOutput (logprobs=0: the sampled token's)."""
    ids = list(output.token_ids)
    return ids, [lp[t].logprob for t, lp in zip(ids, output.logprobs)]


def _sleeping(llm) -> set[str]:
    """The engine's allocations that sleep: "weights", "kv_cache" (vllm 0.32 keeps the set in the
    executor of the in-process engine core; empty on CPUs, which have no sleep mode)."""
    return set(llm.llm_engine.engine_core.engine_core.model_executor.sleeping_tags)


def full_weights(model, dtype):
    """(HF name, full tensor in `dtype`) one parameter at a time, for sync_weights: each FSDP2 shard is
    cast to `dtype`, then gathered (the cast is elementwise: the same values as gathering, then casting,
    with half the traffic of fp32 for bf16), when asked for, and nothing here keeps it after. Tied
    weights go under both names (embed_tokens and lm_head): embed_tokens alone left vLLM 0.32's CPU
    engine half-updated (tests/test_real.py syncs SmolLM2's tied pair). With LoRA, the merged weights."""
    from infra.lora import is_lora, merged_weights
    if is_lora(model):
        yield from merged_weights(model, dtype)
        return
    for name, tensor in model.state_dict().items():
        shard = tensor.to(dtype)  # (a DTensor stays one, sharded as before)
        gathered = shard.full_tensor() if hasattr(shard, "full_tensor") else shard
        del shard
        yield name, gathered
        del gathered  # (before the next one is gathered)


def sync_weights(llm, named_tensors) -> None:
    """Load the trainer's weights in place from an iterator of (HF name, tensor) (`reload_weights`).
    A sleeping engine wakes its weights only: the KV cache stays freed until wake_for_rollout."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the trainer's cached blocks back to the device, for the engine's weights
    if "weights" in _sleeping(llm):
        llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
    llm.reset_prefix_cache()  # cached prefixes were computed by the old weights


SLEEP_LEVEL = 2  # what sleep() drops (2: weights and KV cache; 1: the weights copied to host memory)


def sleep(llm) -> None:
    """Free GPU memory for training: the weights and the KV cache dropped (level 2). The next
    sync_weights writes every weight, so level 1's copy of them to pinned host memory and back (2 x
    27.5 GiB per GPU and step at 14B) would be thrown away. vLLM 0.32 keeps at level 2 what the sync
    does not write: the model's buffers (rotary tables, attention scales) are copied to host memory and
    back on the next wake of the weights (v1/worker/gpu_worker.py sleep, wake_up), the "runtime" pool is
    backed up at every level (device_allocator/sleep_mode_backend.py), and the CUDA graphs stay on the
    GPU. A no-op on CPUs (no sleep mode there); tests/test_engine.py checks that a sync writes every
    parameter."""
    if llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
        llm.sleep(level=SLEEP_LEVEL)


def wake_for_rollout(llm) -> None:
    """Wake what still sleeps (after a sync, only the KV cache); the scheduler resumes once all is.
    Weights still asleep at level 2 were dropped: woken, they would hold whatever the memory held."""
    asleep = _sleeping(llm)
    if "weights" in asleep and SLEEP_LEVEL == 2:
        raise RuntimeError("the engine's weights were dropped when it slept and nothing has loaded them "
                           "since\n---> HINT: sync_weights(llm, full_weights(model, dtype)) between "
                           "sleep(llm) and wake_for_rollout(llm)")
    if asleep:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the reload's scratch, still reserved, back to the device for the cache
        llm.wake_up(tags=sorted(asleep))


def kv_capacity_tokens(engine) -> int:
    """How many tokens an LLMEngine's KV cache holds: vllm 0.32 keeps the block count in the cache
    config, one of which (the null block) never holds a token."""
    cache = engine.vllm_config.cache_config
    return (cache.num_gpu_blocks - 1) * cache.block_size


def kv_block_tokens(engine) -> int:
    """Tokens per KV-cache block, the unit the engine allocates in: vllm 0.32 keeps it in the
    engine's cache config. 1 for an engine without one (tests' fakes)."""
    config = getattr(engine, "vllm_config", None)
    return config.cache_config.block_size if config is not None else 1


def shutdown(llm) -> None:
    """Stop the engine and free what it holds, leaving torch.distributed as it was. vllm 0.32's engine
    shutdown (v1/engine/core.py EngineCore.shutdown, run by `del llm` whenever the collector gets to it)
    ends in cleanup_dist_env_and_memory, which destroys the default process group: the trainer's ranks
    could then no longer meet in a barrier before the group goes (a rank that tears gloo down while
    another talks to it can abort). So this runs EngineCore.shutdown's steps but the last, and destroys
    vLLM's own groups (distributed/parallel_state.py), not torch's; train.py then meets the other ranks
    and destroys the process group once."""
    import gc
    from vllm.distributed import parallel_state
    client = llm.llm_engine.engine_core                  # the in-process client
    client._finalizer.detach()                           # (its finalizer is EngineCore.shutdown)
    core = client.engine_core
    core.structured_output_manager.clear_backend()
    core.model_executor.shutdown()
    core.scheduler.shutdown()
    gc.unfreeze()  # (EngineCore.__init__ froze the start-up objects: the engine's memory is freed with them)
    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
