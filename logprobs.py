"""Token log-probs, the numbers both losses use: log p(token t+1 | tokens <= t) at every position.

1. token_logprobs: the model runs without its head; the head, the temperature and the log-softmax
   run over chunks of positions of the final hidden states, so no tensor of tokens x vocabulary ever
   exists, only chunk x vocabulary. Each chunk is recomputed in the backward (recompute=True, GPUs),
   or its logits are kept for it (recompute=False: faster where memory is plenty, as on a CPU with a
   small vocabulary).
2. SharedPrefix: the tokens that every sequence of a step starts with (the system prompt and the
   user turn's preamble: ~410 of SmolLM2's ~430-token prompts) run once for the step instead of
   once per sequence. Their keys and values, and their last hidden state, are kept as leaves that
   every micro-batch reads; the gradients the micro-batches leave on them go back through the
   prefix's own forward once, after the last micro-batch. The log-probs and the gradient are those
   of running every sequence whole (tests/test_training.py checks both). It needs the model's KV
   cache, which transformers drops under gradient checkpointing: it is for models trained without
   activation checkpointing (train.py: on CPUs; on GPUs a prompt is small next to 8K-token responses).
"""
import warnings

import torch
from torch.utils.checkpoint import checkpoint

LOGPROB_CHUNK_TOKENS = 1024  # positions per chunk: 0.6 GB of fp32 logits at a 152K vocabulary
# FSDP2 warns that the outputs include a view (the embeddings): nothing here changes them in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def token_logprobs(model, input_ids, attention_mask, temperature: float = 1.0,
                   chunk_tokens: int = LOGPROB_CHUNK_TOKENS, prefix=None, recompute: bool = True):
    """(1) log softmax(logits / temperature)[input_ids[:, t + 1]] at every position t: (B, T-1), fp32.
    `prefix` (a SharedPrefix): every row starts with its tokens; only the rest of each row runs, and
    positions before prefix.length - 1 (prefix tokens scoring prefix tokens: no loss counts them)
    hold 0."""
    start = prefix.length if prefix is not None else 0
    batch = input_ids.shape[0]
    if prefix is None:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                    output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1][:, :-1]                   # (B, T-1, H), after the final norm
    else:
        out = model(input_ids=input_ids[:, start:], attention_mask=attention_mask,
                    past_key_values=prefix.cache(batch), use_cache=True, output_hidden_states=True,
                    logits_to_keep=1)
        # the prefix's last position scores the first token after it
        hidden = torch.cat([prefix.last_hidden(batch), out.hidden_states[-1][:, :-1]], dim=1)  # (B, T-P, H)
    positions, width = hidden.shape[1], hidden.shape[2]
    hidden = hidden.reshape(batch * positions, width)           # (N, H)
    targets = input_ids[:, max(start, 1):].reshape(batch * positions)  # (N,)
    head = model.get_output_embeddings()
    chunks = []
    for begin in range(0, batch * positions, chunk_tokens):
        piece = (hidden[begin:begin + chunk_tokens], targets[begin:begin + chunk_tokens], head.weight,
                 head.bias, temperature)
        chunks.append(checkpoint(_chunk_logprobs, *piece, use_reentrant=False) if recompute
                      else _chunk_logprobs(*piece))
    logp = torch.cat(chunks).view(batch, positions)             # (B, T-1), or (B, T-P) after a prefix
    if prefix is not None:
        logp = torch.cat([logp.new_zeros(batch, start - 1), logp], dim=1)  # (B, T-1)
    return logp


def _chunk_logprobs(hidden, targets, weight, bias, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # (n, V)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)    # (n,)


def shared_prefix_length(rows) -> int:
    """(2) How many tokens every row starts with; at most the shortest row less one, so that every
    row keeps a token after the prefix."""
    shared = min(len(row) for row in rows) - 1
    first = rows[0]
    for row in rows[1:]:
        same = 0
        while same < shared and row[same] == first[same]:
            same += 1
        shared = same
    return max(shared, 0)


class SharedPrefix:
    """(2) A prefix every sequence of a step starts with, run once. Make it before the step's first
    micro-batch (under no_grad for old log-probs: then there is nothing to send back), pass it to
    token_logprobs, and call backward() after the last micro-batch's backward, before the optimizer
    step: every rank, its micro-batches empty or not (FSDP's collectives need them all)."""

    def __init__(self, model, prefix_ids):
        """prefix_ids: (P,) on the model's device, P >= 1."""
        if getattr(model, "is_gradient_checkpointing", False):
            raise ValueError("a shared prefix needs the KV cache, which transformers drops under gradient "
                             "checkpointing\n---> HINT: run the prompts whole (no prefix) with activation "
                             "checkpointing on")
        out = model(input_ids=prefix_ids[None], use_cache=True, output_hidden_states=True, logits_to_keep=1)
        kv = [(layer[0], layer[1]) for layer in out.past_key_values]  # per layer: (1, heads, P, head_dim)
        self._outputs = [t for pair in kv for t in pair] + [out.hidden_states[-1][:, -1:]]
        self._leaves = [t.detach().requires_grad_(torch.is_grad_enabled()) for t in self._outputs]
        self.length = prefix_ids.shape[0]

    def cache(self, batch: int):
        """The prefix's keys and values for `batch` rows, as a fresh cache (the model appends the rows'
        own keys and values to it)."""
        from transformers import DynamicCache
        leaves = self._leaves[:-1]
        return DynamicCache([(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1))
                             for k, v in zip(leaves[0::2], leaves[1::2])])

    def last_hidden(self, batch: int):
        """The final hidden state of the prefix's last position: (B, 1, H)."""
        return self._leaves[-1].expand(batch, -1, -1)

    def backward(self) -> None:
        """The micro-batches' summed gradients through the prefix's forward, once (zeros where none)."""
        if self._outputs and self._outputs[0].requires_grad:
            grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in self._leaves]
            torch.autograd.backward(self._outputs, grads)
        self._outputs = self._leaves = []
