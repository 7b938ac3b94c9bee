"""Token log-probs, the numbers both losses use: log p(token t+1 | tokens <= t) at every position.

- token_logprobs: the model runs without its head (final_hidden); the head, the temperature and the
  log-softmax run over chunks of positions, so no tensor of tokens x vocabulary ever exists. Each chunk
  is recomputed in the backward (recompute=True, GPUs), or its logits kept for it (recompute=False: on
  a CPU with a small vocabulary). entropy=True also returns each position's entropy (train.py logs its
  mean, the sign of an entropy collapse): measured, not trained.
- SharedPrefix: the tokens every sequence of a step starts with (the system prompt and the user turn's
  preamble: ~410 of SmolLM2's ~430-token prompts) run once for the step instead of once per sequence.
  Their keys and values, and their last hidden state, are kept as leaves that every micro-batch reads;
  the gradients the micro-batches leave on them go back through the prefix's forward once, at the end.
  The log-probs and the gradient are those of running every sequence whole (tests/test_training.py
  checks both). It needs the KV cache, which gradient checkpointing drops: train.py uses it on CPUs.
- Packing (token_logprobs(packed=True)): a micro-batch's rows run as one row without padding, each
  sequence its own positions and causal block; the log-probs come back in the padded layout.
- trajectory_tensors: the ids, masks and sampler log-probs of trajectories as the losses read them.
"""
import warnings

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

LOGPROB_CHUNK_TOKENS = 1024  # positions per chunk: 0.6 GB of fp32 logits at a 152K vocabulary
# FSDP2 warns that the outputs include a view (the embeddings): nothing here changes them in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def token_logprobs(model, input_ids, attention_mask, temperature: float = 1.0,
                   chunk_tokens: int = LOGPROB_CHUNK_TOKENS, prefix=None, recompute: bool = True,
                   packed: bool = False, entropy: bool = False):
    """log softmax(logits / temperature)[input_ids[:, t + 1]] at every position t: (B, T-1), fp32.
    `prefix` (a SharedPrefix): every row starts with its tokens; only the rest of each row runs, and
    positions before prefix.length - 1 (prefix tokens scoring prefix tokens: no loss counts them)
    hold 0. `packed` (packing): the right-padded rows run as one row without their padding; the log-probs
    come back in the padded layout, 0 on padding. `entropy`: (log-probs, entropies), the second the
    entropy of softmax(logits / temperature) at each position, (B, T-1) without a gradient, 0 where
    the log-probs are."""
    if packed:
        return _packed_logprobs(model, input_ids, attention_mask, temperature, chunk_tokens, prefix,
                                recompute, entropy)
    start = prefix.length if prefix is not None else 0
    batch = input_ids.shape[0]
    if prefix is None:
        _, last = final_hidden(model, input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = last[:, :-1]                                   # (B, T-1, H), after the final norm
    else:
        _, last = final_hidden(model, input_ids=input_ids[:, start:], attention_mask=attention_mask,
                               past_key_values=prefix.cache(batch), use_cache=True)
        # the prefix's last position scores the first token after it
        hidden = torch.cat([prefix.last_hidden(batch), last[:, :-1]], dim=1)               # (B, T-P, H)
    positions, width = hidden.shape[1], hidden.shape[2]
    hidden = hidden.reshape(batch * positions, width)           # (N, H)
    targets = input_ids[:, max(start, 1):].reshape(batch * positions)  # (N,)
    values = _head_logprobs(model, hidden, targets, temperature, chunk_tokens, recompute, entropy)

    def place(x):  # (N,) -> (B, T-1)
        x = x.view(batch, positions)                            # (B, T-1), or (B, T-P) after a prefix
        return x if prefix is None else torch.cat([x.new_zeros(batch, start - 1), x], dim=1)
    return (place(values[:, 0]), place(values[:, 1].detach())) if entropy else place(values)


def final_hidden(model, **inputs):
    """The forward (logits of the last position only) and the final hidden states (B, T, H), after the
    norm: with gradients among the root's outputs, where FSDP2 hooks the root's backward; without, only
    them (output_hidden_states would keep every layer's: ~3 GB at 14B and 8K tokens)."""
    if torch.is_grad_enabled():
        out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
        return out, out.hidden_states[-1]
    captured = []
    hook = model.get_decoder().register_forward_hook(lambda m, a, out: captured.append(out.last_hidden_state))
    try:
        out = model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    return out, captured[-1]


def _head_logprobs(model, hidden, targets, temperature, chunk_tokens, recompute, entropy=False):
    """The head and the log-softmax over chunks of positions: hidden (N, H), targets (N,) -> (N,), or
    with `entropy` (N, 2): the log-probs and the entropies."""
    head = model.get_output_embeddings()
    chunks = []
    for begin in range(0, hidden.shape[0], chunk_tokens):
        piece = (hidden[begin:begin + chunk_tokens], targets[begin:begin + chunk_tokens], head.weight,
                 head.bias, temperature, entropy)
        chunks.append(checkpoint(_chunk_logprobs, *piece, use_reentrant=False) if recompute
                      else _chunk_logprobs(*piece))
    return torch.cat(chunks)


def _packed_logprobs(model, input_ids, attention_mask, temperature, chunk_tokens, prefix, recompute,
                     entropy=False):
    """(packing) The right-padded rows as one row of their tokens back to back. Each sequence keeps its own
    positions and its own causal block (itself and the shared prefix, never the sequence before it),
    so the log-probs and the gradients are the padded rows' (tests/test_training.py), while no padding
    runs through the layers or the head: a micro-batch costs its tokens, not rows x its longest row."""
    start = prefix.length if prefix is not None else 0
    batch = input_ids.shape[0]
    valid = attention_mask[:, start:].bool()                               # (B, T-P): the tokens that run
    lengths = valid.sum(1)                                                 # (B,)
    flat = input_ids[:, start:][valid]                                     # (L,): the rows back to back
    every = torch.arange(flat.shape[0], device=flat.device)                # (L,)
    row = torch.repeat_interleave(torch.arange(batch, device=flat.device), lengths)  # (L,)
    offset = every - (torch.cumsum(lengths, 0) - lengths)[row]             # (L,): position in its row
    position_ids = (start + offset)[None]                                  # (1, L)
    if model.config._attn_implementation in ("sdpa", "eager"):
        model.config._attn_implementation = PACKED_ATTENTION  # (once: it is sdpa for unpacked rows)
    _, last = final_hidden(model, input_ids=flat[None], position_ids=position_ids,
                           packed_lengths=lengths.tolist(), use_cache=prefix is not None,
                           past_key_values=prefix.cache(1) if prefix is not None else None)   # (1, L, H)
    if prefix is None:
        scored = offset > 0                           # a row's first token has no position before it
        hidden = last[0][every[scored] - 1]                                # (N, H)
        targets = flat[scored]                                             # (N,)
        layout = attention_mask[:, 1:].bool()                              # (B, T-1)
    else:  # every token is scored by the position before it: its own row's, or the prefix's last
        hidden = torch.cat([prefix.last_hidden(1)[0], last[0]])                        # (1 + L, H)
        hidden = hidden[torch.where(offset > 0, every, 0)]                             # (L, H)
        targets = flat                                                                 # (L,)
        layout = valid                                                                 # (B, T-P)
    values = _head_logprobs(model, hidden, targets, temperature, chunk_tokens, recompute, entropy)

    def place(x):  # (N,) -> (B, T-1)
        x = x.new_zeros(layout.shape).masked_scatter(layout, x)           # (B, T-1), or (B, T-P)
        return x if prefix is None else torch.cat([x.new_zeros(batch, start - 1), x], dim=1)
    return (place(values[:, 0]), place(values[:, 1].detach())) if entropy else place(values)


def _packed_attention(module, query, key, value, attention_mask, packed_lengths=None, **kwargs):
    """(packing) Attention over a packed row, one sequence at a time: each attends to the shared
    prefix's keys (those before the row's) and causally to itself, so it costs the sum of each
    sequence's square, not the row's (flash-attention's varlen does the same in one kernel; sdpa, on
    CPUs too, gets a sequence at a time). Rows that are not packed: transformers' sdpa.
    query (1, heads, L, d); key, value (1, kv heads, P + L, d) -> (1, L, heads, d)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if packed_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    prefix, outputs = key.shape[2] - query.shape[2], []
    # One split per tensor, not a slice per sequence: the backward of a slice is a zero tensor of the
    # whole row that its gradient is copied into and summed, so slices cost sequences x row in the
    # backward (measured: fills, copies and adds took more of an SFT step than the matmuls did).
    queries = query.split(packed_lengths, dim=2)                                 # (1, heads, n, d) each
    prefix_key, *keys = key.split([prefix, *packed_lengths], dim=2)             # (1, kv heads, n, d) each
    prefix_value, *values = value.split([prefix, *packed_lengths], dim=2)
    for q, k, v, n in zip(queries, keys, values, packed_lengths):
        mask = None
        if prefix:  # all of the prefix, then causal: row i sees keys up to prefix + i
            k = torch.cat([prefix_key, k], dim=2)                                    # (1, kv heads, P + n, d)
            v = torch.cat([prefix_value, v], dim=2)                                  # (1, kv heads, P + n, d)
            mask = torch.ones(n, prefix + n, dtype=torch.bool, device=query.device).tril(prefix)[None, None]
        out, _ = sdpa_attention_forward(module, q, k, v, mask, is_causal=not prefix, **kwargs)
        outputs.append(out)                                                          # (1, n, heads, d)
    return torch.cat(outputs, dim=1), None


PACKED_ATTENTION = "rstar2_packed_sdpa"
AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # (the padded rows' masks, as sdpa's)


def _chunk_logprobs(hidden, targets, weight, bias, temperature, entropy=False):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # (n, V)
    log_z = logits.logsumexp(-1)                                                    # (n,)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z                  # (n,)
    if not entropy:
        return logp
    with torch.no_grad():  # H = log Z - E_p[logits]; a measurement: nothing (n, V) more is kept
        h = log_z - (torch.softmax(logits, -1) * logits).sum(-1)                    # (n,)
    return torch.stack([logp, h], dim=-1)                                           # (n, 2)


def shared_prefix_length(rows) -> int:
    """How many tokens every row starts with, for a SharedPrefix; at most the shortest row less one,
    so that every row keeps a token after the prefix."""
    shared = min(len(row) for row in rows) - 1
    first = rows[0]
    for row in rows[1:]:
        same = 0
        while same < shared and row[same] == first[same]:
            same += 1
        shared = same
    return max(shared, 0)


class SharedPrefix:
    """A prefix every sequence of a step starts with, run once. Make it before the step's first
    micro-batch (under no_grad for old log-probs: then there is nothing to send back), pass it to
    token_logprobs, and call backward() after the last micro-batch's backward, before the optimizer
    step: every rank, its micro-batches empty or not (FSDP's collectives need them all)."""

    def __init__(self, model, prefix_ids):
        """prefix_ids: (P,) on the model's device, P >= 1."""
        if getattr(model, "is_gradient_checkpointing", False):
            raise ValueError("a shared prefix needs the KV cache, which transformers drops under gradient "
                             "checkpointing\n---> HINT: run the prompts whole (no prefix) with activation "
                             "checkpointing on")
        out, last = final_hidden(model, input_ids=prefix_ids[None], use_cache=True)
        kv = [(layer[0], layer[1]) for layer in out.past_key_values]  # per layer: (1, heads, P, head_dim)
        self._outputs = [t for pair in kv for t in pair] + [last[:, -1:]]
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


def empty_pass(model, pad_id: int, device) -> None:
    """A forward (and, with gradients on, a backward) of two tokens, zero loss: a rank's pass with nothing."""
    input_ids = torch.full((1, 2), pad_id, device=device)
    logp = token_logprobs(model, input_ids, torch.ones_like(input_ids))
    if torch.is_grad_enabled():
        (logp.sum() * 0.0).backward()


def right_pad(rows: list, value, dtype=None) -> torch.Tensor:
    """Rows of different lengths as one tensor, right-padded with `value`: (B, longest row)."""
    return torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r, dtype=dtype) for r in rows], True, value)


def trajectory_tensors(trajs, pad_id: int, device):
    """The trainer's view of trajectories: input_ids, attention_mask, loss_mask, sampler_logp. The log-prob
    at position k scores token k + 1: the loss mask (0 on the prompt and every tool turn) and the
    sampler's log-probs are shifted by one against the ids (response token r at len(prompt) - 1 + r)."""
    ids = [np.concatenate([t.prompt_ids, t.response_ids]) for t in trajs]
    pre = [(len(t.prompt_ids) - 1, 0) for t in trajs]  # (the zeros before a response's first token)
    input_ids = right_pad(ids, pad_id, torch.long)                                            # (B, T)
    attention_mask = right_pad([np.ones(len(x)) for x in ids], 0, torch.long)                 # (B, T)
    loss_mask = right_pad([np.pad(t.loss_mask, k) for k, t in zip(pre, trajs)], 0, torch.long)   # (B, T-1)
    sampler_logp = right_pad([np.pad(t.logprobs, k) for k, t in zip(pre, trajs)], 0.0, torch.float)  # (B,T-1)
    return tuple(x.to(device) for x in (input_ids, attention_mask, loss_mask, sampler_logp))
