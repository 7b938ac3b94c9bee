"""The memory plan of one GPU (and of a node's host memory) through an RL step, from the model's config.

Every GPU runs one FSDP2 trainer rank and one vLLM engine (infra/engine.py, infra/training.py, train.py).
The plan adds up, phase by phase, what each holds; P is the parameter count, N the number of GPUs.
Bytes per GPU:

1. Resume (a run's own checkpoint, --init-from): the checkpoint loads before the engine takes its share
  (or with it asleep). torch's get_optimizer_state_dict first materialises the optimizer state with zero
  gradients and one AdamW step: 16P/N. At start-up rank 0 moves each full module to its GPU as FSDP2
  shards it (training.load_sharded_model).
2. Rollout: the engine awake inside its share of the GPU (vLLM's gpu_memory_utilization): bf16
  weights (2P), CUDA graphs, its persistent buffers, the profile's transient peak and the KV cache,
  which is what the share leaves. Beside it the trainer's fp32 weights and AdamW moments (12P/N),
  unless they are offloaded (6), which leaves the engine 12P/N more.
3. Training (forward and backward, the engine asleep but for its CUDA graphs and the buffers outside
  its sleep pools): weights, gradients, moments (16P/N); the root (embeddings, head) gathered in bf16;
  two decoder layers gathered; each layer's input kept (activation checkpointing); the padding mask.
  The peak is the largest of three moments of the backward (_training): a. the log-prob chunks
  (logprobs.token_logprobs); b. a decoder layer's recomputation; c. the root's reduce at the end.
4. Optimizer step: weights, gradients, moments: 16P/N (fused AdamW: no temporary).
  Training and the optimizer step also count the caching allocator's reserve beyond the tensors it
  holds: the trainer allocates in expandable segments (training.expandable_segments), a fraction
  then (RESERVED_OVER_ALLOCATED).
5. Weight sync (engine.sync_weights): the engine's weights woken, not its KV cache, beside the
  trainer's 12P/N, and vLLM's layerwise reload of the largest module (Shape.reload_peak_bytes).
Every phase also pays the CUDA context and NCCL's buffers, and keeps a margin free.
6. Offload (offload_trainer): the trainer's fp32 shards and moments (12P/N) go to pinned host memory
  after the sync (and checkpoint, export) and come back after the engine sleeps: 24P/N bytes per
  step per GPU over PCIe. "auto" offloads when that at least doubles the rollouts the engine holds
  at their longest, or when nothing fits without it. The engine must start after the offload: vLLM
  asks for its share of the GPU free at start-up.
7. Host memory of the busiest node (node 0): the sleeping engines' pinned backups, the offloaded
  trainer state, the trajectories, rank 0's HF export, the sandbox workers, each rank's process.
  (Rank 0 reads the model, 4P, at start-up, before any of these; a sandbox call may use up to its
  memory cap, 1 GiB, while it runs: not counted.)
8. Reference (reference=True: a frozen copy for a KL penalty; run_settings follows
  training.load_reference's rule): its bf16 weights sharded (2P/N) in every phase, offloaded with the
  trainer; in training also its root gathered in bf16, which FSDP2 keeps until update.MiniBatch.finish.
  A pass without gradients keeps only the final hidden states (logprobs.final_hidden).
The engine's share goes to vLLM as gpu_memory_utilization (memory_fraction), not as the KV cache's
bytes: vLLM then measures its own weights, buffers, transient peak and CUDA graphs and sizes the KV
cache to fit the share, so an estimate here that is too small shrinks the KV cache instead of
overrunning the GPU. These are estimates from parameter counts and read sources (vLLM 0.32's, torch
2.13's), not measurements: docs/gpu.md's first GPU run checklist says how to check them.
"""
from dataclasses import dataclass

from infra.engine import SLEEP_LEVEL
from infra.logprobs import LOGPROB_CHUNK_TOKENS
from infra.lora import lora_settings
from infra.update import MICRO_BATCH_TOKENS
from rollout import MAX_PROMPT, PROBLEMS_PER_STEP, ROLLOUTS_PER_PROBLEM, STAGE_ROLLOUTS


# -----------------------------------------------------------------------------
# The model's shape, from a config (Shape: a Qwen or Llama decoder's counts); KNOWN holds the
# architectures of docs/gpu.md's table (the hub's config.json values), so it needs no download.
# Each row: _FIELDS in order; every one of them has heads of 128.
_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
           "num_key_value_heads", "vocab_size", "tie_word_embeddings")
KNOWN = {name: dict(zip(_FIELDS, counts), head_dim=128) for name, counts in {
    "Qwen2.5-1.5B": (28, 1536, 8960, 12, 2, 151936, True),
    "Qwen2.5-7B": (28, 3584, 18944, 28, 4, 152064, False),
    "Qwen3-8B": (36, 4096, 12288, 32, 8, 151936, False),
    "Qwen3-14B": (40, 5120, 17408, 40, 8, 151936, False),
    "Qwen2.5-32B": (64, 5120, 27648, 40, 8, 152064, False),
}.items()}


@dataclass
class Shape:
    """What the plan needs of a model: counts, not weights."""
    layers: int
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config) -> "Shape":
        """From a transformers config or a dict of its fields."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        return cls(layers=get("num_hidden_layers"), hidden=get("hidden_size"), mlp=get("intermediate_size"),
                   heads=heads, kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or get("hidden_size") // heads, vocab=get("vocab_size"),
                   tied=bool(get("tie_word_embeddings", False)))

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        queries_and_output = 2 * self.hidden * self.q_width
        keys_and_values = 2 * self.hidden * self.kv_width
        return queries_and_output + keys_and_values + 3 * self.hidden * self.mlp + 2 * self.hidden

    def adapter_params(self, rank: int) -> int:
        """LoRA's parameters in one decoder layer, every linear layer adapted (infra/lora.py's all-linear):
        r x (inputs + outputs) for q, k, v, o, gate, up, down."""
        h, q, kv, mlp = self.hidden, self.q_width, self.kv_width, self.mlp
        return rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + mlp) + (mlp + h))

    @property
    def embedding_params(self) -> int:
        """Embeddings and head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of every layer, bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def layer_activation_bytes(self) -> int:
        """Bytes per token of one decoder layer in its backward: what the recomputed forward keeps
        (HF's Qwen3 layer; Qwen2.5 has no q/k norms, a few % over) and the gradients beside it.
        Per hidden unit 30: two RMSNorms (fp32 input 4, bf16 product 2, output 2), the outputs of
        o_proj and down_proj and the two residual sums (2 each), gradients of the residual stream (6).
        Per query unit 18: q (2), its norm (8), rotary's rotated copy and result (4), attention's
        output and o_proj's input (4). Per key/value unit 16: k and v (4), k's norm (8), rotary (4).
        Per MLP unit 12: gate, up, their activation and product (8), two of their gradients (4)."""
        return 30 * self.hidden + 18 * self.q_width + 16 * self.kv_width + 12 * self.mlp

    @property
    def reload_peak_bytes(self) -> int:
        """The weight sync's transient (vllm/model_executor/model_loader/reload/layerwise.py): the
        online loader buffers each incoming bf16 tensor of a vLLM module until the module's count is
        complete, then _layerwise_process materialises the module on the GPU (materialize_layer),
        loads the buffered tensors into it and copies it into the woken weights. The trainer gathers
        each tensor in bf16 (engine.full_weights casts the shard first), into a buffer padded to
        whole shards beside the result: 2 x module + 2 x module + 2 x last tensor, for each module kind
        of a Qwen/Llama model (qkv_proj from q, k, v; gate_up_proj from gate, up; single tensors)."""
        h = self.hidden
        embeddings = self.vocab * h                                   # the embeddings, and the head
        qkv = h * (self.q_width + 2 * self.kv_width)
        gate_up = 2 * h * self.mlp
        modules = [(embeddings, embeddings), (qkv, h * self.kv_width), (gate_up, h * self.mlp),
                   (h * self.q_width, h * self.q_width), (h * self.mlp, h * self.mlp)]
        return max(4 * size + 2 * last for size, last in modules)

# -----------------------------------------------------------------------------
# The plan

GiB = 2**30
MiB = 2**20
CONTEXT = 4 * GiB         # CUDA context, NCCL's buffers (the trainer's, the engine's), allocator slack
MARGIN = 3 * GiB          # kept free in every phase: fragmentation, what the estimates miss
GPUS_PER_NODE = 8

# ---- the engine (vLLM 0.32) ----
# vllm/v1/worker/gpu_worker.py determine_available_memory: KV cache = gpu_memory_utilization x total
#   - (what the engine allocated since its start-up snapshot: weights, buffers) - (the profile's
#   transient peak) - (the CUDA graphs' estimate, subtracted by default:
#   VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 in vllm/envs.py). vllm/v1/worker/utils.py request_memory
#   also requires utilization x total <= the free memory when the engine starts.
CUDA_GRAPHS = 1 * GiB     # an estimate of the graph pool: vLLM measures it (gpu_model_runner.py
#   profile_cudagraph_memory) for the capture sizes of config/vllm.py (1, 2, 4, 8..248 by 8,
#   256..512 by 16), and logs "CUDA graph pool memory: ... (actual), ... (estimated)"
ENGINE_BUFFERS = GiB // 2  # the runner's other persistent buffers, block tables, attention metadata,
#   non-torch allocations (cuBLAS, Triton): an estimate
# engine/arg_utils.py get_batch_defaults, the LLM class: (max_num_batched_tokens, max_num_seqs); GPUs
# of 70 GiB and more (but A100s: 8192 and 256, which the plan then overcounts) get the larger pair
VLLM_BATCH_LARGE_GPU = (16384, 1024)
VLLM_BATCH_SMALL_GPU = (8192, 256)
# gpu_model_runner.py _dummy_sampler_run: max_num_seqs rows of logits through the sampler in the
# profile; with logprobs_mode="processed_logprobs" (infra/engine.py) the CUDA sampler is the PyTorch one
# (v1/sample/ops/topk_topp_sampler.py forward_native): the bf16 logits the caller keeps (2), their
# fp32 copy (4), the processed log-probs (4), the probabilities (4), random_sample's noise (4)
SAMPLER_BYTES_PER_LOGIT = 2 + 4 + 4 + 4 + 4
SAMPLER_TRITON_ROWS = 304  # v1/sample/ops/topk_topp_triton.py caches a (rows, V) fp32 buffer, rows at most
#   the GPU's SMs: 132 on an H100, 304 CUs on an MI300X (the larger counted)

# ---- the trainer (torch 2.13); a decoder layer's activations: Shape.layer_activation_bytes ----
LOGIT_BYTES_TRAINING = 16  # a log-prob chunk's backward per logit: the fp32 logits the log-sum-exp keeps,
#   the gradients of the gather and of the log-sum-exp, their sum (logprobs._chunk_logprobs)
FINAL_HIDDEN_BYTES = 12    # per token and hidden unit: the last layer's output (2), the final norm's fp32
#   input (4) and bf16 product (2) kept for its backward, its output (2), the positions' (N, h) copy (2)
RESERVED_OVER_ALLOCATED = 0.10  # the allocator's reserve while the trainer works, over its tensors. Without
#   expandable segments an H100 measured 1.39x at 1.7B and 1.16x at 4B (docs/gpu.md); with them (each
#   segment grows in place) the target is within 10%: counted here, not yet measured on a GPU
MASK_BYTES = 3             # transformers' sdpa mask when a micro-batch is padded: (B, 1, T, T) bool, and
#   torch's float copy of it for the memory-efficient kernel (2)

# ---- offload and host memory ----
HOST_LINK_BYTES_PER_S = 25e9  # an assumed effective pinned host<->GPU copy rate per GPU (PCIe Gen5 x16
#   is 64 GB/s a direction in theory, Gen4 32; GPUs behind one switch share it)
OFFLOAD_GAIN = 2.0         # offload_trainer="auto" offloads when it multiplies rollouts at once by this
TRAJECTORY_BYTES = 90      # per token of a rollout.Trajectory while it grows: a token id (a list slot and an
#   int object), its log-prob (a slot and a float), its loss-mask slot, the text (measured, tracemalloc);
#   scored, its tokens are arrays (9 bytes), and a rank trains on about its own share's worth of them
NUMBERS_BYTES = 1024       # a trajectory without its tokens (batch.without_payload): ~370 measured, rounded up
SANDBOX_SLOT = (101 + 17) * MiB  # a slot's "full" and "light" workers (sandbox.py), RSS measured on a CPU;
#   a running call may add up to its memory_mb (1 GiB by default), not counted
PROCESS_HOST = 5 * GiB     # a rank's process: Python, torch, CUDA and NCCL libraries, vLLM: an estimate

def pinned_bytes(nbytes: int) -> int:
    """The pinned host memory an allocation of `nbytes` holds: torch 2.13's caching host allocator
    rounds every request up to a power of two and keeps the block once freed, for the next request of
    its size (ATen/core/CachingHostAllocator.h allocate, free; pinned_max_round_threshold and
    pinned_max_cached_size are unlimited unless PYTORCH_CUDA_ALLOC_CONF sets them)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def weight_allocations(s: Shape) -> list[int]:
    """The engine's bf16 weights as the allocations of vLLM's sleep pool, each of which a level-1 sleep
    backs up into a pinned tensor of its own (device_allocator/cumem.py sleep). torch's caching
    allocator gives a tensor of 10 MiB and more its own segment rounded up to 2 MiB and packs the
    others into 20 MiB (over 1 MiB) and 2 MiB segments (c10/core/AllocatorConfig.h kMinLargeAlloc,
    kRoundLarge, kLargeBuffer, kSmallBuffer); per layer vLLM fuses q, k, v and gate, up."""
    h = s.hidden
    layer = [h * (s.q_width + 2 * s.kv_width), h * s.q_width, 2 * h * s.mlp, s.mlp * h]
    tensors = [2 * n for n in layer * s.layers + [s.vocab * h] * (1 if s.tied else 2)]
    # norms, q/k norms, Qwen2.5's q/k/v biases: small, packed
    small = 2 * (s.layers * (2 * h + 2 * s.head_dim + s.q_width + 2 * s.kv_width) + h)
    segments = [-(-n // (2 * MiB)) * 2 * MiB for n in tensors if n >= 10 * MiB]
    packed = sum(n for n in tensors if n < 10 * MiB) + small
    return segments + [20 * MiB] * -(-packed // (20 * MiB))


def engine_host_backup(s: Shape, sleep_level: int) -> int:
    """The pinned host memory one sleeping engine keeps (its blocks stay cached when it wakes): its
    runtime pool at every level (an estimate, ENGINE_BUFFERS) and, at level 1, its weights."""
    allocations = [ENGINE_BUFFERS] + (weight_allocations(s) if sleep_level == 1 else [])
    return sum(pinned_bytes(n) for n in allocations)


@dataclass
class Plan:
    """Bytes per GPU in each phase (each a dict of named terms), the engine's share and KV cache,
    the offload decision, and the host memory of the busiest node."""
    params: int
    gpu: int
    ranks: int
    rollout_tokens: int     # what one rollout reserves: prompt + response
    phases: dict            # phase -> {term: bytes}; the phase's peak is their sum
    host: dict              # term -> bytes, the host memory of node 0
    memory_fraction: float  # vLLM's gpu_memory_utilization: the engine's share, CUDA graphs included
    kv_cache: int           # the KV cache the plan expects vLLM to size from memory_fraction
    rollouts_at_once: int
    offload: bool
    rollouts_with_offload: dict  # {False: rollouts at once without offloading, True: with}
    offload_bytes_per_step: int  # host <-> GPU, both directions, per GPU
    offload_seconds: float       # at HOST_LINK_BYTES_PER_S
    training: str = ""           # ", LoRA rank r" when the base is frozen, ", a frozen reference"

    @property
    def peaks(self) -> dict:
        return {phase: sum(terms.values()) for phase, terms in self.phases.items()}

    @property
    def host_per_node(self) -> int:
        return sum(self.host.values())

    @property
    def fits(self) -> bool:
        return self.rollouts_at_once >= 1 and max(self.peaks.values()) <= self.gpu - MARGIN


def _engine(s: Shape, gpu_gib: float) -> tuple[dict, dict]:
    """The engine's terms awake (all but its KV cache), and those that stay on the GPU while it sleeps:
    its CUDA graphs (outside the sleep pools unless sleep_mode_offload_cudagraph: config/vllm.py
    use_cumem_cudagraph_pool, compilation/cudagraph_pool.py capture_pool) and the buffers it allocates
    outside the pools (device_allocator/sleep_mode_backend.py: sleep backs up the "runtime" pool to
    host memory, and at level 1 the "weights", and drops the rest)."""
    batched_tokens, seqs = VLLM_BATCH_LARGE_GPU if gpu_gib >= 70 else VLLM_BATCH_SMALL_GPU
    asleep = {"engine: CUDA graphs (on the GPU asleep too)": CUDA_GRAPHS,
              "engine: buffers": (batched_tokens * s.hidden * 2            # the runner's inputs_embeds
                                  + SAMPLER_TRITON_ROWS * s.vocab * 4      # the top-k/top-p buffer
                                  + ENGINE_BUFFERS)}
    # the profile (gpu_model_runner.py profile_run): a forward of max_num_batched_tokens (at its MLP:
    # gate-up output and product, 6 bytes per MLP unit; residual, norm, attention output, layer
    # output, 8 per hidden unit), then the sampler over max_num_seqs rows with the hidden states kept
    forward = batched_tokens * (8 * s.hidden + 6 * s.mlp)
    sampler = seqs * s.vocab * SAMPLER_BYTES_PER_LOGIT + batched_tokens * s.hidden * 2
    awake = {"engine: bf16 weights": 2 * s.params, **asleep,
             "engine: profile's transient peak": max(forward, sampler)}
    return awake, asleep


def _trainer_state(s: Shape, ranks: int, lora_rank: int, gradients: bool, lora_head: bool = False) -> dict:
    """The trainer's weights and AdamW moments per GPU (and its gradients, while it trains): fp32 all
    16 bytes a parameter; with LoRA (infra/lora.py) the base frozen in bf16, 2, and the adapters' 16 (and the
    head's, with lora_head: train.py --lora-train lm_head)."""
    what = "gradients, AdamW moments" if gradients else "AdamW moments"
    state_bytes = 16 if gradients else 12
    if not lora_rank:
        return {f"trainer: fp32 weights, {what}": state_bytes * s.params // ranks}
    adapters = s.layers * s.adapter_params(lora_rank)
    head = s.vocab * s.hidden if lora_head else 0
    terms = {"trainer: bf16 frozen base": 2 * (s.params - head) // ranks,
             f"trainer: fp32 adapters, {what}": state_bytes * adapters // ranks}
    if lora_head:
        terms[f"trainer: fp32 head, {what}"] = state_bytes * head // ranks
    return terms


def _training(s: Shape, ranks: int, micro_batch_tokens: int, rollout_tokens: int, logprob_chunk: int,
              lora_rank: int = 0, lora_head: bool = False) -> dict:
    """The trainer's terms at the worst of the backward's three moments (the module's docstring, 3).
    With LoRA the embeddings are frozen and so is the head unless lora_head (no gradient of theirs, no
    root reduce), and a layer's gradients are its adapters'."""
    h, v = s.hidden, s.vocab
    tokens = max(micro_batch_tokens, rollout_tokens)  # a row over the budget goes alone (plan_micro_batches)
    always = _trainer_state(s, ranks, lora_rank, gradients=True, lora_head=lora_head)
    trained = s.adapter_params(lora_rank) if lora_rank else s.layer_params  # a layer's trained parameters
    head_gradient = 0 if lora_rank and not lora_head else 2 * v * h
    # FSDP2 does not reshard the root after its forward (fsdp/_fully_shard/_fsdp_state.py)
    kept = {"root gathered (bf16)": 2 * s.embedding_params,
            "each layer's input (checkpoints)": 2 * s.layers * tokens * h,
            "padding mask": MASK_BYTES * micro_batch_tokens * min(micro_batch_tokens, rollout_tokens)}
    logprob_chunks = {"two layers gathered (bf16)": 2 * 2 * s.layer_params,
                      "final hidden states and norm": FINAL_HIDDEN_BYTES * tokens * h,
                      "a log-prob chunk's logits and gradients":
                          LOGIT_BYTES_TRAINING * min(logprob_chunk, tokens) * v,
                      "head's bf16 gradient": head_gradient,
                      "a chunk's head-gradient temporary": head_gradient}
    # FSDP2 copies a module's bf16 gradients into one fp32 buffer to reduce-scatter them
    # (fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce)
    layer = {"two layers gathered (bf16)": 2 * 2 * s.layer_params,
             "a layer's bf16 gradients, fp32 reduce copy": (2 + 4) * trained,
             "a layer's activations recomputed": tokens * s.layer_activation_bytes,
             "head's bf16 gradient": head_gradient}
    root_gradients = (2 + 4) * (v * h if lora_head else 0) if lora_rank else (2 + 4) * s.embedding_params
    root_reduce = {"root's bf16 gradients, fp32 reduce copy": root_gradients}
    moments = [{**always, **kept, **logprob_chunks}, {**always, **kept, **layer}, {**always, **root_reduce}]
    return max(moments, key=lambda terms: sum(terms.values()))


def _allocator_reserve(trainer_terms: dict) -> dict:
    """3-4. What the caching allocator reserves beyond what the trainer's tensors hold: with expandable
    segments (training.expandable_segments) a fraction of them."""
    reserve = int(RESERVED_OVER_ALLOCATED * sum(trainer_terms.values()))
    return {"allocator: reserved beyond allocated": reserve}


def _reference(s: Shape, ranks: int, reference: bool) -> dict:
    """8. The frozen reference copy's bf16 weights per GPU, sharded as the trainer's are."""
    return {"reference: frozen bf16 weights": 2 * s.params // ranks} if reference else {}


def _phases(s: Shape, ranks: int, gpu: int, micro_batch_tokens: int, rollout_tokens: int, offload: bool,
            logprob_chunk: int, lora_rank: int = 0, lora_head: bool = False,
            reference: bool = False) -> tuple[dict, int]:
    """Every phase's terms for one offload choice, and the engine's share of the GPU."""
    p = s.params
    context = {"CUDA context, NCCL": CONTEXT}
    engine, engine_asleep = _engine(s, gpu / GiB)
    frozen = _reference(s, ranks, reference)
    trainer_state = {**_trainer_state(s, ranks, lora_rank, gradients=False, lora_head=lora_head), **frozen}
    beside_trainer = {**frozen, **engine_asleep, **context}  # while the engine sleeps
    # 2. the share is what the trainer and the context leave, less the margin; the KV cache what the
    # rest of the engine leaves of it
    share = gpu - MARGIN - CONTEXT - (0 if offload else sum(trainer_state.values()))
    kv_cache = {"engine: KV cache": max(0, share - sum(engine.values()))}
    rollout = {**({} if offload else trainer_state), **context, **engine, **kv_cache}
    # The reference is allocated once and never resized while the trainer works, so the allocator's
    # reserve, which comes from the trainer's churn of tensors, does not grow with it.
    training = _training(s, ranks, micro_batch_tokens, rollout_tokens, logprob_chunk, lora_rank, lora_head)
    training = {**training, **_allocator_reserve(training), **beside_trainer}
    if reference:  # 8. its root stays gathered through the micro-batches
        training["reference: root gathered (bf16)"] = 2 * s.embedding_params
    # 4. fused AdamW (train.py on GPUs) updates each parameter in one kernel, no temporary (foreach AdamW
    # kept sqrt(second moment) of every parameter at once, 4P/N more: torch/optim/adam.py _multi_tensor_adam)
    initialised = _trainer_state(s, ranks, lora_rank, gradients=True, lora_head=lora_head)
    step = {**initialised, **_allocator_reserve(initialised), **beside_trainer}
    # 1. torch/distributed/checkpoint/state_dict.py _init_optim_state: zero gradients and a step with lr 0;
    # at start-up FSDP2 moves each module of rank 0's model to the GPU whole before sharding it
    dtype, weight_bytes = ("bf16", 2) if lora_rank else ("fp32", 4)  # (a LoRA base is read in bf16)
    loading = {f"trainer: {dtype} shards": weight_bytes * p // ranks,
               f"a module in full ({dtype})": weight_bytes * max(s.embedding_params, s.layer_params)}
    resume = {**max(initialised, loading, key=lambda terms: sum(terms.values())), **beside_trainer}
    # 5. the trainer's state is still on the GPU: it offloads after the sync
    sync = {**trainer_state, "engine: bf16 weights": 2 * p, **engine_asleep,
            "reload: a module's tensors, its copy, a gather's buffer": s.reload_peak_bytes,
            **context}
    if lora_rank:  # lora.merged_weights, the largest matrix (an MLP's): gathered, its fp32 sum, the result
        sync["merge: a weight in bf16, fp32, bf16"] = (2 + 4 + 2) * s.hidden * s.mlp
    phases = {"resume": resume, "rollout": rollout, "training": training, "optimizer step": step,
              "sync": sync}
    return phases, share


def plan(config, ranks: int, gpu_gib: float, micro_batch_tokens: int, rollout_tokens: int,
         offload: str = "auto", logprob_chunk: int = LOGPROB_CHUNK_TOKENS,
         rollouts_per_step: int = PROBLEMS_PER_STEP * ROLLOUTS_PER_PROBLEM,
         cores_per_node: int = 224, sleep_level: int = SLEEP_LEVEL, lora_rank: int = 0,
         lora_head: bool = False, reference: bool = False) -> Plan:
    """The plan for `ranks` GPUs of `gpu_gib` GiB each, training in bf16 with fp32 master weights.
    offload: "on", "off" or "auto" (see the module's docstring, 6). rollouts_per_step: the whole batch
    every rank holds (the paper's 512 problems x 32); cores_per_node: the hardware threads the sandbox
    divides (a DGX H100 has 224); sleep_level: engine.sleep's; lora_rank: train.py --lora-rank (0: full
    fine-tuning); lora_head: the head trained in full beside the adapters (--lora-train lm_head);
    reference: a frozen reference model for a KL penalty (the module's docstring, 8)."""
    if offload not in ("auto", "on", "off"):
        raise ValueError(f"offload={offload!r}\n---> HINT: offload_trainer is one of auto, on, off")
    s = Shape.of(config)
    gpu, p = int(gpu_gib * GiB), s.params
    tried = {}
    for choice in (False, True):
        phases, share = _phases(s, ranks, gpu, micro_batch_tokens, rollout_tokens, choice, logprob_chunk,
                                lora_rank, lora_head, reference)
        at_once = phases["rollout"]["engine: KV cache"] // (s.kv_bytes_per_token * rollout_tokens)
        tried[choice] = phases, share, at_once
    # auto: when offloading at least doubles the rollouts at once. (Offloading changes only the
    # rollout phase, so when nothing fits without it, no rollout fits: any that fits with it doubles.)
    without, with_ = tried[False][2], tried[True][2]
    chosen = offload == "on" or (offload == "auto" and with_ > without and with_ >= OFFLOAD_GAIN * without)
    phases, share, at_once = tried[chosen]

    # 7. node 0's host memory. The sleeping engines' backups are pinned (device_allocator/cumem.py
    # sleep), and torch's caching host allocator keeps pinned blocks once freed (torch/accelerator/
    # memory.py empty_host_cache), so they count all the time; so does the trainer's offload.
    per_node = min(ranks, GPUS_PER_NODE)
    whole_batch = rollouts_per_step * rollout_tokens  # tokens, every rollout at its longest
    slots = per_node * max(1, cores_per_node // per_node - 1)  # sandbox.default_workers on every rank
    # The trainer's host buffers are allocated once and kept (offload.trainer_offloaded), each at its
    # exact size: registered pageable memory, not torch's pinned pool, which rounds up to a power of two.
    state = sum(_trainer_state(s, ranks, lora_rank, gradients=False, lora_head=lora_head).values())
    state += sum(_reference(s, ranks, reference).values())
    host = {"engines asleep: pinned backups": per_node * engine_host_backup(s, sleep_level),
            "trainer offloaded: pinned weights, moments": per_node * state if chosen else 0,
            "trajectories: each rank's own, every one's numbers":
                per_node * (whole_batch // ranks * TRAJECTORY_BYTES + rollouts_per_step * NUMBERS_BYTES),
            # training.save_hf_checkpoint: get_model_state_dict(cpu_offload=True) keeps it on rank 0 only
            # (torch/distributed/checkpoint/state_dict.py _maybe_full_or_cpu_state_dict), then .to(bf16)
            # (LoRA: lora.merged_weights gives the bf16 state dict itself)
            "rank 0's HF export: fp32 state dict, bf16 copy": (2 if lora_rank else 4 + 2) * p,
            "sandbox workers": slots * SANDBOX_SLOT,
            "processes": per_node * PROCESS_HOST}
    moved = 2 * state if chosen else 0
    lora = f", LoRA rank {lora_rank}{' and the head' if lora_head else ''}" if lora_rank else ""
    return Plan(params=p, gpu=gpu, ranks=ranks, rollout_tokens=rollout_tokens, phases=phases, host=host,
                memory_fraction=max(0.0, share / gpu), kv_cache=phases["rollout"]["engine: KV cache"],
                rollouts_at_once=at_once, offload=chosen,
                rollouts_with_offload={False: without, True: with_},
                offload_bytes_per_step=moved, offload_seconds=moved / HOST_LINK_BYTES_PER_S,
                training=lora + (", a frozen reference" if reference else ""))  # (describe's first line)


def _terms(terms: dict, indent: str) -> list[str]:
    """Terms as 'name 1.2' pieces, wrapped under ~110 characters."""
    lines, line = [], indent
    for name, size in terms.items():
        piece = f"{name} {size / GiB:.1f}"
        if len(line) + len(piece) > 108 and line.strip():
            lines.append(line.rstrip(", "))
            line = indent
        line += piece + ", "
    return lines + [line.rstrip(", ")]


def describe(p: Plan) -> str:
    """The plan as the lines train.py --plan prints: every phase with its terms (GiB)."""
    gib = lambda n: f"{n / GiB:.1f}"  # noqa: E731
    offload = "on" if p.offload else "off"
    without, with_ = p.rollouts_with_offload[False], p.rollouts_with_offload[True]
    lines = [f"memory plan per GPU ({p.params / 1e9:.1f}B parameters{p.training}, {p.ranks} GPUs of "
             f"{p.gpu / GiB:.0f} GiB; from the config, not measured; GiB)",
             f"  engine share (--memory-fraction) {p.memory_fraction:.3f}: KV cache {gib(p.kv_cache)}; "
             f"a rollout holds up to {p.rollout_tokens} tokens:",
             f"      {p.rollouts_at_once} at once at their longest",
             f"  trainer offload: {offload} ({with_} rollouts at once with it, {without} without)"]
    if p.offload:
        lines.append(f"      {gib(p.offload_bytes_per_step)} GiB moved per step per GPU (both ways): "
                     f"{p.offload_seconds:.1f} s at {HOST_LINK_BYTES_PER_S / 1e9:.0f} GB/s")
    for phase, terms in p.phases.items():
        lines.append(f"  {phase}: peak {gib(sum(terms.values()))}")
        lines += _terms(terms, "      ")
    lines.append(f"  host memory of node 0 ({min(p.ranks, GPUS_PER_NODE)} GPUs): {gib(p.host_per_node)}")
    lines += _terms(p.host, "      ")
    lines.append(f"  fits: {'yes' if p.fits else 'NO'} (every phase within {p.gpu / GiB:.0f} GiB less a "
                 f"{MARGIN / GiB:.0f} GiB margin)")
    return "\n".join(lines)


def sizing_table(ranks: int = 8, micro_batch_tokens: int = MICRO_BATCH_TOKENS,
                 rollout_tokens: int = MAX_PROMPT + STAGE_ROLLOUTS[1]["max_response"]) -> str:
    """docs/gpu.md's table: the KNOWN models on 80 and 192 GiB GPUs, stage 1, offload auto."""
    rows = ["| model | parameters | KV per token | GPUs | trainer offload | KV cache | rollouts at once "
            "| peak GiB: resume / training / optimizer step / sync | host per node |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, config in KNOWN.items():
        kv_per_token = Shape.of(config).kv_bytes_per_token // 1024
        for gpu in (80, 192):
            p = plan(config, ranks, gpu, micro_batch_tokens, rollout_tokens)
            phases = ("resume", "training", "optimizer step", "sync")
            peaks = " / ".join(f"{p.peaks[phase] / GiB:.0f}" for phase in phases)
            kv = f"{p.kv_cache / GiB:.0f} GiB" if p.fits else "does not fit"
            at_once = str(p.rollouts_at_once) if p.fits else ""
            offload = "on" if p.offload else "off"
            rows.append(f"| {name} | {p.params / 1e9:.1f}B | {kv_per_token} KiB | {ranks} x {gpu} GiB "
                        f"| {offload} | {kv} | {at_once} | {peaks} | {p.host_per_node / GiB:.0f} GiB |")
    return "\n".join(rows)


def add_plan_flags(group) -> None:
    """train.py's flags of the memory plan."""
    group.add_argument("--offload-trainer", choices=["auto", "on", "off"], default="auto",
                       help="the trainer's fp32 shards and AdamW moments in host memory while the engine "
                            "rolls out (auto: when the plan says it doubles the rollouts the engine holds)")
    group.add_argument("--plan", nargs="?", const="auto", default=None, metavar="GPUSxGIB",
                       help="print the memory plan per GPU (from the model's config alone) and exit: "
                            "for GPUS GPUs of GIB GiB, e.g. 8x80 (default: torchrun's world size, else 8; "
                            "this GPU's memory, else 80)")


def run_settings(args) -> dict:
    """What plan() takes of train.py's flags. A reference copy where training.load_reference loads one:
    a KL penalty without LoRA, or with a module trained in full beside the adapters."""
    trained_in_full = (lora_settings(args) or {}).get("train_modules", [])
    return dict(micro_batch_tokens=args.micro_batch_tokens,
                rollout_tokens=args.max_prompt + args.max_response,
                rollouts_per_step=args.problems_per_step * args.rollouts_per_problem,
                lora_rank=args.lora_rank, lora_head="lm_head" in trained_in_full,
                reference=args.kl_coef > 0 and not (args.lora_rank and not trained_in_full))


def plan_for_model(model: str, ranks: int, gpu_gib: float | None = None, **settings) -> Plan:
    """The plan of `model` (a KNOWN name, an HF folder or hub id) on `ranks` GPUs of `gpu_gib` GiB
    (default: this GPU's, else 80); `settings` as plan() takes them."""
    import torch
    from transformers import AutoConfig
    config = KNOWN[model] if model in KNOWN else AutoConfig.from_pretrained(model)
    if gpu_gib is None:
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / GiB if torch.cuda.is_available() else 80
    return plan(config, ranks, gpu_gib, **settings)


def report(args, world_size: int) -> int:
    """train.py --plan: print the plan of its flags; the exit status says whether it fits (0) or not (1)."""
    gpus, _, gib = ("" if args.plan == "auto" else args.plan).partition("x")  # GPUSxGIB
    gpus, gib = int(gpus or world_size or 8), float(gib) if gib else None  # (None: this GPU's, else 80)
    trained = (lora_settings(args) or {}).get("train_modules", [])
    if [m for m in trained if m != "lm_head"]:
        print(f"(the plan counts a trained lm_head, not {','.join(trained)}: 14 bytes a parameter more)")
    p = plan_for_model(args.model, gpus, gib, offload=args.offload_trainer, **run_settings(args))
    print(describe(p))
    return 0 if p.fits else 1


def gpu_settings(args, device, ranks: int, log) -> tuple[float | None, bool]:
    """train.py's (engine share, offload the trainer?) from its flags. On GPUs the plan, which `log`
    prints, decides what is "auto" (SystemExit with what to do if it does not fit); on CPUs there is no
    share and the trainer offloads only when asked ("on": the same code path, copies within host memory)."""
    if device.type != "cuda":
        return None, args.offload_trainer == "on"
    p = plan_for_model(args.model, ranks, offload=args.offload_trainer, **run_settings(args))
    log(describe(p))
    if not p.fits:
        raise SystemExit("the memory plan above does not fit these GPUs\n---> HINT: --offload-trainer on, "
                         "fewer --micro-batch-tokens, more GPUs (the trainer's share shrinks with them), "
                         "or a smaller model")
    return (p.memory_fraction if args.memory_fraction == "auto" else float(args.memory_fraction)), p.offload


if __name__ == "__main__":  # self-check: prints docs/gpu.md's sizing table
    print(sizing_table())
