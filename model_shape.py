"""What the memory plan needs of a model: its counts, from its config, not its weights.

Shape reads a transformers config (or a dict of its fields) of a Qwen or Llama decoder and counts its
parameters, its KV cache per token, and the bytes of the tensors the memory plan adds up (memory_plan.py).
KNOWN holds the architectures of docs/gpu.md's table, so the plan of those needs no download.
"""
from dataclasses import dataclass

# The architectures of docs/gpu.md's table (the hub's config.json values), so it needs no download.
KNOWN = {
    "Qwen2.5-1.5B": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960,
                         num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-7B": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064,
                       tie_word_embeddings=False),
    "Qwen3-8B": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
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
        """LoRA's parameters in one decoder layer, every linear layer adapted (lora.py's all-linear):
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
