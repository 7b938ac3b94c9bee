"""The memory plan of one GPU through an RL step, computed from the model's config and the run's settings.

A step cycles through three phases on every GPU (engine.py, train.py):
1. Rollout: the vLLM engine awake (its bf16 weights, its own buffers, the KV cache) beside the
   trainer's resident state (fp32 weight shards and the two AdamW moments: 12 bytes per parameter,
   sharded over the ranks; gradients are freed after each step).
2. Training: the engine asleep (weights in host memory, KV cache freed). The trainer holds weights,
   gradients and moments (16 bytes per parameter, sharded); the root's embeddings and head stay
   gathered in bf16 through forward and backward and are reduced in fp32; two decoder layers are
   gathered at a time; activations are checkpointed per layer (each layer's input kept, one layer
   recomputed); the log-probs run over chunks of positions (training.token_logprobs).
3. Weight sync: the engine's weights woken, one parameter gathered in fp32 and converted at a time.
Every phase also pays the CUDA context and NCCL's buffers. The engine's share of the GPU
(vLLM's gpu_memory_utilization) is what the trainer leaves during the rollout, less a margin;
the KV cache is that share less the engine's weights and buffers; a rollout at its longest
holds prompt + response tokens of it, which says how many fit at once in the worst case (the
scheduler admits by what rollouts hold, so more run while they are short).
These are estimates from parameter counts, not measurements: the README's first-GPU-run checklist
says how to check them.
"""
from dataclasses import dataclass

GiB = 2**30
CONTEXT = 4 * GiB        # CUDA context, NCCL buffers, allocator slack
ENGINE_BUFFERS = 2 * GiB  # vLLM's activations for a batch of tokens, sampler, CUDA graphs
MARGIN = 3 * GiB         # kept free in every phase: fragmentation, what the estimates miss

# The architectures of the README's table (the hub's config.json values), so it needs no download.
KNOWN = {
    "Qwen2.5-1.5B": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960,
                         num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-7B": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064,
                       tie_word_embeddings=False),
    "Qwen3-14B": dict(num_hidden_layers=40, hidden_size=5120, intermediate_size=17408,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False),
    "Qwen2.5-32B": dict(num_hidden_layers=64, hidden_size=5120, intermediate_size=27648,
                        num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=152064,
                        tie_word_embeddings=False),
}


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
    def layer_params(self) -> int:
        queries_and_output = 2 * self.hidden * self.heads * self.head_dim
        keys_and_values = 2 * self.hidden * self.kv_heads * self.head_dim
        return queries_and_output + keys_and_values + 3 * self.hidden * self.mlp + 2 * self.hidden

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


@dataclass
class Plan:
    """Bytes per GPU in each phase, and what they leave for rollouts."""
    params: int
    trainer_resident: int   # 12P/N: fp32 shards and AdamW moments, during rollout and sync
    engine_weights: int     # 2P: the engine's bf16 copy
    memory_fraction: float  # the engine's share of the GPU, weights and KV cache included
    kv_cache: int
    rollout_tokens: int     # what one rollout reserves: prompt + response
    rollouts_at_once: int
    training_peak: int
    sync_peak: int
    host: int               # a node's host memory: the asleep engines' weights, rank 0 reading the model
    gpu: int

    @property
    def fits(self) -> bool:
        return self.rollouts_at_once >= 1 and max(self.training_peak, self.sync_peak) <= self.gpu - MARGIN


def plan(config, ranks: int, gpu_gib: float, micro_batch_tokens: int, rollout_tokens: int,
         logprob_chunk: int = 1024) -> Plan:
    """The plan for `ranks` GPUs of `gpu_gib` GiB each, training in bf16 with fp32 master weights."""
    s = Shape.of(config)
    gpu, p = int(gpu_gib * GiB), s.params
    trainer_resident = 12 * p // ranks
    engine_weights = 2 * p
    engine_share = gpu - trainer_resident - CONTEXT - MARGIN
    kv_cache = max(0, engine_share - engine_weights - ENGINE_BUFFERS)
    # training: a row longer than the micro-batch budget goes alone, so a micro-batch can be that long
    tokens = max(micro_batch_tokens, rollout_tokens)
    root = 2 * s.embedding_params + 4 * s.embedding_params  # gathered bf16, gradients reduced in fp32
    layers = 2 * 2 * s.layer_params                         # two layers gathered in bf16 (one prefetched)
    checkpoints = 2 * s.layers * tokens * s.hidden          # each layer's bf16 input, kept
    recompute = 2 * tokens * (6 * s.hidden + 4 * s.mlp)     # one layer's activations, recomputed
    logprobs = 3 * 4 * min(logprob_chunk, tokens) * s.vocab  # a chunk's fp32 logits, softmax and gradient
    training_peak = 16 * p // ranks + root + layers + checkpoints + recompute + logprobs + CONTEXT
    largest = max(s.vocab * s.hidden, s.hidden * s.mlp)
    sync_peak = trainer_resident + engine_weights + 6 * largest + CONTEXT  # one fp32 gather + bf16 copy
    at_once = kv_cache // (s.kv_bytes_per_token * rollout_tokens)
    return Plan(params=p, trainer_resident=trainer_resident, engine_weights=engine_weights,
                memory_fraction=max(0.0, engine_share / gpu), kv_cache=kv_cache,
                rollout_tokens=rollout_tokens, rollouts_at_once=at_once,
                training_peak=training_peak, sync_peak=sync_peak, host=2 * p * min(ranks, 8) + 4 * p, gpu=gpu)


def describe(p: Plan, ranks: int) -> str:
    """The plan as the lines train.py --plan prints."""
    g = lambda n: f"{n / GiB:6.1f} GiB"  # noqa: E731
    lines = [f"memory plan per GPU ({p.params / 1e9:.1f}B parameters, {ranks} GPUs of {p.gpu / GiB:.0f} GiB; "
             f"computed from the config, not measured)",
             f"  rollout:  trainer shards + AdamW {g(p.trainer_resident)}, "
             f"engine weights {g(p.engine_weights)}, KV cache {g(p.kv_cache)}",
             f"            engine share (--memory-fraction) {p.memory_fraction:.2f}; a rollout holds up to "
             f"{p.rollout_tokens} tokens: {p.rollouts_at_once} at once at their longest",
             f"  training: peak {g(p.training_peak)} (engine asleep)",
             f"  sync:     peak {g(p.sync_peak)} (engine weights awake, one parameter gathered)",
             f"  host memory of a node of 8: {g(p.host)} (the engines' weights while asleep, rank 0's load)",
             f"  fits: {'yes' if p.fits else 'NO'} (a margin of {MARGIN / GiB:.0f} GiB kept free)"]
    return "\n".join(lines)


def sizing_table(ranks: int = 8, micro_batch_tokens: int = 8192, rollout_tokens: int = 2048 + 8192) -> str:
    """The README's table: the KNOWN models on 80 and 192 GiB GPUs, stage 1."""
    rows = ["| model | parameters | trainer shards + AdamW | engine weights | training peak | KV per token "
            "| 8 x 80 GiB: KV cache, rollouts at once | 8 x 192 GiB: KV cache, rollouts at once |",
            "|---|---|---|---|---|---|---|---|"]
    for name, config in KNOWN.items():
        cells = []
        for gpu in (80, 192):
            p = plan(config, ranks, gpu, micro_batch_tokens, rollout_tokens)
            cells.append(f"{p.kv_cache / GiB:.0f} GiB, {p.rollouts_at_once}" if p.fits else "does not fit")
        p = plan(config, ranks, 80, micro_batch_tokens, rollout_tokens)
        rows.append(f"| {name} | {p.params / 1e9:.1f}B | {p.trainer_resident / GiB:.1f} GiB | "
                    f"{p.engine_weights / GiB:.1f} GiB | {p.training_peak / GiB:.0f} GiB | "
                    f"{Shape.of(config).kv_bytes_per_token // 1024} KiB | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


if __name__ == "__main__":  # self-check: prints the README's sizing table
    print(sizing_table())
