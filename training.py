"""The training machinery sft.py and train.py share (eval.py uses the process group and the reader).

1. The process group: torchrun's environment, or a group of one; NCCL on GPUs, gloo on CPUs.
2. FSDP2: every decoder layer sharded, then the root (embeddings, final norm, head); bf16 compute
   with fp32 master weights and fp32 gradient reduction on GPUs, fp32 throughout on CPUs.
3. Micro-batches: one plan for a step's sequences. They are dealt longest first, each to the rank
   with the fewest tokens so far; each rank's share is cut into micro-batches by a token budget;
   every rank runs as many passes as the busiest (FSDP's collectives need all ranks in each one).
4. Token log-probs: log p(token t+1 | tokens <= t) at every position, the numbers both losses use.
5. HF export: the full weights gathered from the shards and written by rank 0, with the tokenizer.
6. The problem reader: {"question", "answer"} JSONL, checked line by line.
"""
import copy
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# -----------------------------------------------------------------------------
# (1) The process group


def init_distributed():
    """Join torchrun's process group, or make a group of one. Returns (rank, local_rank, world_size, device)."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":  # torch.cuda is also the ROCm device API
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized() and "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    elif not dist.is_initialized():  # a group of one needs no rendezvous: an in-process store, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return rank, local_rank, world_size, device


# -----------------------------------------------------------------------------
# (2) FSDP2


def shard_model(model, device):
    """Shard every decoder layer (the model's `_no_split_modules`), then the root."""
    on_gpu = device.type == "cuda"
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if on_gpu else None,
                                     reduce_dtype=torch.float32 if on_gpu else None)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layer_classes = getattr(model, "_no_split_modules", None) or []
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"no decoder layers in {type(model).__name__}\n"
                         f"---> HINT: shard_model shards the classes named in model._no_split_modules")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


# -----------------------------------------------------------------------------
# (3) Micro-batches


def plan_micro_batches(lengths: list[int], budget: int, world_size: int) -> list[list[list[int]]]:
    """Per rank, its micro-batches as lists of indices into `lengths`: rows x longest row <= budget
    (a sequence longer than the budget goes alone). All ranks get the same number of micro-batches;
    a rank with fewer sequences gets empty ones at the end (see empty_pass)."""
    shares, load = [[] for _ in range(world_size)], [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # longest first, to the lightest rank
        lightest = load.index(min(load))
        shares[lightest].append(i)
        load[lightest] += lengths[i]
    plans = []
    for share in shares:  # each share is longest first: a micro-batch's first row is its longest
        batches = []
        for i in share:
            if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
                batches[-1].append(i)
            else:
                batches.append([i])
        plans.append(batches)
    passes = max(len(batches) for batches in plans)
    return [batches + [[] for _ in range(passes - len(batches))] for batches in plans]


def right_pad(rows: list[list], value) -> torch.Tensor:
    """Rows of different lengths as one tensor, right-padded with `value`: (B, longest row)."""
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows])


def empty_pass(model, pad_id: int, device) -> None:
    """A forward and backward of one token with a zero loss, for a rank with no micro-batch left."""
    logits = model(input_ids=torch.full((1, 1), pad_id, device=device), use_cache=False).logits
    (logits.sum() * 0.0).backward()


# -----------------------------------------------------------------------------
# (4) Token log-probs


def token_logprobs(model, input_ids, attention_mask):
    """log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) for every t: (B, T - 1), fp32."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]  # (B, T-1, V)
    targets = input_ids[:, 1:, None]  # (B, T-1, 1)
    return torch.log_softmax(logits.float(), -1).gather(-1, targets).squeeze(-1)  # (B, T-1)


# -----------------------------------------------------------------------------
# (5) HF export


def save_hf_checkpoint(model, tokenizer, out_dir: str, dtype=torch.float32) -> None:
    """Gather the full state dict from the FSDP2 shards and write an HF checkpoint (on rank 0).
    Every rank must call this: the gather is a collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        model.save_pretrained(out_dir, state_dict={k: v.to(dtype) for k, v in state_dict.items()})
        config = copy.deepcopy(model.config)  # save_pretrained wrote the dtype of the fp32 master
        config.dtype = dtype                  # weights; vLLM's dtype="auto" must read the saved one
        config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()


# -----------------------------------------------------------------------------
# (6) The problem reader


def read_problems(path: str) -> list[dict]:
    """{"question": str, "answer": ...} per line (other fields kept, the answer made a string)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file\n---> HINT: `python data/prepare_rl.py` writes data/rl.jsonl, "
                                f"`python data/prepare_eval.py` the benchmarks, `python data/prepare_toy.py` "
                                f"the toy world")
    problems = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row = f"not JSON ({e})"
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) \
                    or not row["question"].strip() or not str(row.get("answer", "")).strip():
                raise ValueError(f"{path}:{line_number}: a problem needs a question and an answer, got "
                                 f"{line.strip()[:200]}\n---> HINT: each line is "
                                 f'{{"question": ..., "answer": ...}}; fix or drop this line')
            problems.append(dict(row, answer=str(row["answer"])))
    if not problems:
        raise ValueError(f"{path}: no problems in the file\n---> HINT: check that it was written completely")
    return problems
