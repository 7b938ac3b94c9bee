"""The training machinery sft.py and train.py share (eval.py uses the process group).

- The process group: torchrun's or one of one; NCCL on GPUs, gloo on CPUs, its collectives with a
  timeout of minutes, and a gloo group with a long one for objects and waits: no rank ever waits
  inside an NCCL collective, and a rank that stops answering in training fails the job in minutes.
- The model: rank 0 reads the checkpoint, the others build it on the meta device; FSDP2 shards each
  decoder layer, then the root; bf16 compute over fp32 master weights on GPUs, fp32 on CPUs; the
  trainer's GPU memory in expandable segments (off while the engine is awake); the reference policy
  of a KL penalty.
- The HF export, by rank 0 (the engine gets the weights through engine.full_weights).
- Checkpoints: sharded, written to step_N.tmp and renamed to step_N once complete (a crash never
  leaves a broken step_N), the newest N kept, loaded with or without the optimizer; with LoRA, the
  adapters only. The run's logs are rewound to the checkpoint on resume; the collapse alarm.
- Files: the check that every rank sees the output folder (all write checkpoints, one renames).
"""
import copy
import datetime
import glob
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from conversation import chat_template
from infra.engine import engine_dtype
from infra.lora import add_lora, is_lora, lora_rank, merged_weights, trains_adapters_only

# -----------------------------------------------------------------------------
# The process group

WAIT_TIMEOUT_MINUTES = 240  # the gloo group's: longer than a rank ever waits on the others' rollouts
TIMEOUT_MINUTES = 30  # the training's collectives: ranks in step, so a wait this long is a hang
_cpu_group = None


# The oldest NVIDIA driver branch each CUDA major release of torch runs on (NVIDIA's minor-version
# compatibility; on data-center GPUs the cuda-compat package lifts an older driver)
CUDA_DRIVER = {12: "R525", 13: "R580"}


def gpus_torch_cannot_use() -> str | None:
    """Why this GPU build of torch cannot run on the machine's GPUs; None when it can or there are none. An
    older driver than the build's CUDA needs makes torch.cuda.is_available() false with only a warning:
    a GPU run would quietly become a CPU run. GPUs are counted as torch does without CUDA (NVML or
    amdsmi, within CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES: torch/cuda/__init__.py)."""
    if torch.cuda.is_available():
        return None
    build = f"this torch ({torch.__version__}) is built for"
    if torch.version.cuda and torch.cuda._device_count_nvml() > 0:
        cuda = torch.version.cuda
        driver = CUDA_DRIVER.get(int(cuda.split(".")[0]), f"one of CUDA {cuda}")
        return (f"{build} CUDA {cuda}, which needs an NVIDIA driver {driver} or newer: this machine has GPUs "
                f"but CUDA cannot start on them\n---> HINT: `nvidia-smi` shows the driver's version: update "
                f"the driver (or install NVIDIA's cuda-compat-{cuda.replace('.', '-')} package), or install "
                f"a torch and vLLM built for the CUDA your driver runs; CUDA_VISIBLE_DEVICES= runs on CPUs")
    if torch.version.hip and torch.cuda._device_count_amdsmi() > 0:
        return (f"{build} ROCm {torch.version.hip}, which cannot start on this machine's GPUs\n---> HINT: "
                f"`amd-smi version` shows the amdgpu driver: it must support ROCm {torch.version.hip} "
                f"(docs/gpu.md, Install); HIP_VISIBLE_DEVICES= runs on CPUs")
    return None


def init_distributed(timeout_minutes: float = TIMEOUT_MINUTES, wait_minutes: float = WAIT_TIMEOUT_MINUTES):
    """Join torchrun's process group, or make one of one: its collectives (FSDP's; NCCL on GPUs) fail
    after `timeout_minutes`, the gloo group's waits (cpu_group) after `wait_minutes`. Returns (rank,
    local_rank, world_size, device). A GPU build of torch that cannot use the GPUs stops here, saying why."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if problem := gpus_torch_cannot_use():
        raise SystemExit(problem)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":  # torch.cuda is also the ROCm device API
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized() and "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    elif not dist.is_initialized():  # a group of one needs no rendezvous: an in-process store, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    global _cpu_group
    _cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=wait_minutes))
    return rank, local_rank, world_size, device


def cpu_group():
    """The gloo group for objects and waits, with init_distributed's long timeout (NCCL's watchdog kills a
    rank that waits inside NCCL; a wait for a straggler's rollouts is not a hang)."""
    return _cpu_group

# -----------------------------------------------------------------------------
# The model and FSDP2


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


def expandable_segments(on: bool) -> None:
    """The caching allocator's expandable segments: on while the trainer works (a segment grows in place:
    reserved stays near allocated, docs/gpu.md), off while the engine is awake (offload.trainer_offloaded:
    vLLM's sleep pools want plain segments). Only that field changes: torch resets every field a settings
    string leaves out (torch 2.13, c10/core/AllocatorConfig.h)."""
    current = torch._C._accelerator_getAllocatorSettings() or os.environ.get(
        "PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    fields = [f for f in current.split(",") if f.strip() and f.split(":")[0].strip() != "expandable_segments"]
    torch._C._accelerator_setAllocatorSettings(",".join(fields + [f"expandable_segments:{on}"]))


def load_sharded_model(path: str, device, activation_checkpointing: bool = False, lora: dict | None = None,
                       frozen: bool = False):
    """The model at `path`, sharded: fp32, or with `lora` (lora.lora_settings) a frozen base in the
    engine's dtype and fp32 adapters, or `frozen` whole (a reference policy, in that dtype). Only rank 0
    reads the weights (a node holds one full copy, not one per rank: 8 x 59 GB at 14B); the others build it
    on the meta device, and rank 0's state and buffers (rotary frequencies) are broadcast into every
    rank's shards. The trainer's memory: expandable segments."""
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = engine_dtype(device) if lora or frozen else torch.float32  # (what a sync would cast to)
    expandable_segments(True)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot load the model {path!r}: {e}\n---> HINT: pass --model an HF checkpoint "
                         f"folder or hub id (the toy world's: `python sft.py --preset toy` first)")
    if dist.get_rank() == 0:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = add_lora(model, lora) if lora else model.requires_grad_(not frozen)
    full_state = model.state_dict() if dist.get_rank() == 0 else {}  # (rank 0's adapters: one init for all)
    shard_model(model, device)
    if dist.get_rank() != 0:
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return model.eval() if frozen else model


def load_reference(model, path: str, device):
    """grpo_roc.py (12)'s reference policy: the model at `path` as loaded, whatever checkpoint the run
    continues. Under LoRA with only adapters training, the policy itself with its adapters off
    (lora.adapters_off: no second copy); otherwise a frozen copy, loaded as the policy is. The memory
    plan counts the copy by the same rule (memory_plan.run_settings)."""
    return model if trains_adapters_only(model) else load_sharded_model(path, device, frozen=True)


# -----------------------------------------------------------------------------
# The HF export


def save_hf_checkpoint(model, tokenizer, out_dir: str, dtype=torch.float32, latest: str | None = None):
    """Gather the full state dict from the FSDP2 shards and write an HF checkpoint (on rank 0), and a
    copy at `latest` if given. Every rank must call this: the gather is a collective."""
    if is_lora(model):  # the merged weights under the base model's names: a plain model to its readers
        state_dict = {name: t.cpu() for name, t in merged_weights(model, dtype) if dist.get_rank() == 0}
        model = model.get_base_model()
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        model.save_pretrained(out_dir, state_dict={k: v.to(dtype) for k, v in state_dict.items()})
        config = copy.deepcopy(model.config)  # save_pretrained wrote the dtype of the fp32 master
        config.dtype = dtype                  # weights; vLLM's dtype="auto" must read the saved one
        config.save_pretrained(out_dir)
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = chat_template()  # apply_chat_template and `vllm serve` render our format
        tokenizer.save_pretrained(out_dir)
        if latest:
            shutil.rmtree(latest, ignore_errors=True)
            shutil.copytree(out_dir, latest)
    dist.barrier(group=cpu_group())

# -----------------------------------------------------------------------------
# Checkpoints


def complete_checkpoints(root: str) -> list[str]:
    """The step_N folders under `root` that hold their meta.json (written last), oldest first."""
    done = [d for d in glob.glob(os.path.join(root, "step_*"))
            if not d.endswith(".tmp") and os.path.exists(os.path.join(d, "meta.json"))]
    return sorted(done, key=lambda d: int(d.rsplit("_", 1)[1]))


# What a checkpoint holds of the model: what is trained (LoRA: the adapters; the base is --model's)
TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


KEEP_CHECKPOINTS = 3  # the newest kept: a 14B checkpoint with its optimizer is ~170 GB


def save_checkpoint(model, optimizer, root: str, step: int, meta: dict, keep: int = KEEP_CHECKPOINTS) -> None:
    """Write step_N (model, optimizer, `meta` + the step), keep the newest `keep` (0: all): every rank."""
    final = os.path.join(root, f"step_{step}")
    tmp = final + ".tmp"
    state = {"model": get_model_state_dict(model, options=TRAINED),
             "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(dict(meta, step=step), f)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep] if keep else []:
            shutil.rmtree(old)
    dist.barrier(group=cpu_group())


def load_checkpoint(model, optimizer, path: str, with_optimizer: bool = True) -> dict:
    """Load step_N into the sharded model and, `with_optimizer`, the optimizer; returns its meta. Without,
    the optimizer's state is not even asked for: dcp.load fills in place what is asked for, a fresh
    optimizer's moments and step count included, set_optimizer_state_dict or not."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    saved, rank = meta.get("config", {}).get("lora_rank", 0), lora_rank(model)
    if saved != rank:  # (the two hold different tensors: dcp.load would only say which keys it lacks)
        raise SystemExit(f"{path} was trained with --lora-rank {saved}, this run has --lora-rank {rank}\n"
                         f"---> HINT: continue a run with its own --model and --lora-rank")
    state = {"model": get_model_state_dict(model, options=TRAINED)}
    held = {k.removeprefix("model.") for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            if k.startswith("model.")}
    if held != set(state["model"]):  # (e.g. another train= setting: dcp.load would not say why)
        raise SystemExit(f"{path} holds other trained weights than this run trains (such as "
                         f"{sorted(held ^ set(state['model']))[0]})\n"
                         f"---> HINT: continue a run with its own --model, --lora-rank and --lora-setting")
    if with_optimizer:  # (materialises the optimizer's state: one zero step of AdamW, torch 2.13)
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=TRAINED)  # (dcp.load had every key it asked for)
    if with_optimizer:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return meta


def find_checkpoint(path: str) -> str:
    """`path` if it is a checkpoint (step_N), else the newest complete one in it, else an error."""
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    found = complete_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path}: no complete checkpoint (a step_N folder with its meta.json)\n"
                                f"---> HINT: a run always saves its last step; resume one that stopped early")
    return found[-1]


def start_point(model, optimizer, root: str, init_from: str | None, reset_optimizer: bool, data: str) -> dict:
    """Where a run starts, loaded into `model` and `optimizer`: the newest checkpoint under `root` if it
    has one (a run goes on where it stopped; its logs rewound to it); else with `init_from`, an
    earlier stage's newest, its optimizer unless `reset_optimizer`, and its data position if it read
    the same `data`; else the beginning. Returns {"step", "position", "stream_start", "message"}."""
    start = dict(step=0, position=0, stream_start=0, message="starting from the model's weights")
    if complete_checkpoints(root):
        meta = load_checkpoint(model, optimizer, complete_checkpoints(root)[-1])
        start = dict(step=meta["step"], position=meta["position"], stream_start=meta["stream_start"],
                     message=f"resumed from {root}/step_{meta['step']}: step {meta['step']}, "
                             f"data position {meta['position']}")
        if dist.get_rank() == 0:
            rewind_logs(os.path.dirname(root), meta["step"])
    elif init_from:
        source = find_checkpoint(init_from)
        meta = load_checkpoint(model, optimizer, source, with_optimizer=not reset_optimizer)
        if os.path.abspath(meta["config"]["data"]) == os.path.abspath(data):  # go on where it stopped
            start.update(position=meta["position"], stream_start=meta["position"])
        start["message"] = (f"initialised from {source}" + (" (fresh optimizer)" if reset_optimizer else "")
                            + f"; data position {start['position']}")
    return start


def rewind_logs(out_dir: str, step: int) -> None:
    """Drop what a run logged after `step` (rank 0, at resume): the metrics.jsonl rows and samples.txt
    trajectories of steps whose update was lost with the crash, so each step is logged once."""
    for name, record in (("metrics.jsonl", r'\{"step": '), ("samples.txt", "===== step ")):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                records = re.split(f"(?m)^(?={record})", f.read())  # a row, or a trajectory
            kept = [r for r in records if r and int(re.match(record + r"(\d+)", r).group(1)) <= step]
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(kept)


def collapse_alarms(history: list[dict], row: dict, keys=("tool_calls", "turns")) -> list[str]:
    """The metrics of this step's `row` that fell below half their running mean over the earlier
    steps' rows (`history`): tool use collapsing, seen at the step it starts, not in the final eval."""
    alarms = []
    for key in keys:
        past = [h[key] for h in history]
        mean = sum(past) / max(len(past), 1)
        if past and row[key] < 0.5 * mean:
            alarms.append(f"{key} {row[key]:.2f} fell below half its running mean {mean:.2f}")
    return alarms

# -----------------------------------------------------------------------------
# Files


def check_shared_dir(path: str) -> None:
    """Fail at start-up, on every rank, unless all ranks see `path` as one folder (rank 0 writes a file
    there, all look for it): checkpoints are written by all ranks into one folder, renamed by rank 0."""
    token = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0, group=cpu_group())
    probe = os.path.join(path, f".shared-{token[0]}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        open(probe, "w").close()
    dist.barrier(group=cpu_group())
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, os.path.exists(probe), group=cpu_group())  # (every rank has looked)
    if dist.get_rank() == 0:
        os.remove(probe)
    if not all(seen):
        blind = [rank for rank, ok in enumerate(seen) if not ok]
        raise SystemExit(f"ranks {blind} do not see {path} as rank 0 does: it is not on a filesystem "
                         f"shared by the nodes\n---> HINT: pass --out-dir a folder on a shared filesystem "
                         f"(NFS, Lustre, ...) mounted at the same path on every node")
