"""LoRA for the trainer (train.py --lora-rank r), through peft: a frozen base and trained low-rank adapters.

    model = training.load_sharded_model(path, device, lora=lora_settings(args))   # peft, then FSDP2
    sync_weights(llm, engine.full_weights(model, dtype))                           # merged: W + (alpha/r) B A

Each targeted linear layer computes x W^T + (alpha / r) x A^T B^T with W frozen, A (r, in) and B (out, r)
trained (B starts at zero: step 0 is the base model). The base stays in bf16 on GPUs (no fp32 master
copy, no gradient, no AdamW moments for it) and in fp32 on CPUs (the CPU engine runs fp32: the sync
stays exact); peft keeps the adapters in fp32 and AdamW trains only them. FSDP2 shards the whole:
its mixed precision casts every parameter to bf16 for compute, and only the trainable ones must share
one dtype (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py).

The engine never sees an adapter: each sync and each HF export gets the merged weights under the
base model's names (merged_weights), so vLLM, eval.py and chat.py run a plain model.
The reference policy of train.py --kl-coef is the base: the policy itself with its adapters off
(adapters_off), unless a module trains in full beside them (trains_adapters_only: then
training.load_reference loads a frozen copy).
Checkpoints hold the adapters and their optimizer only (training.save_checkpoint leaves out frozen
parameters: the base is the --model folder, which every run reads); training.load_checkpoint refuses
one of another rank.
"""
import contextlib

import torch

ADAPTER = "default"  # peft's name for the one adapter
# --lora-setting's names and defaults. Peers' RL defaults (verl's and TRL's examples, "LoRA without
# regret"): every linear layer of the decoder but the head, alpha fixed at 32 (so a larger rank starts no
# larger), no dropout: dropout would make the trainer score a different network than the engine samples,
# and its ratio would not start at 1. LoRA's best learning rate is about 10x full fine-tuning's, in RL as
# in SFT ("LoRA without regret"; the toy RL in docs/benchmarks.md agrees): --lr stays full fine-tuning's
# and the adapters train at lr_scale x --lr, so one recipe serves both. train: comma-separated modules
# trained in full beside the adapters, in fp32 at --lr, e.g. lm_head (the toy's: docs/benchmarks.md).
DEFAULTS = dict(alpha=32.0, dropout=0.0, targets="all-linear", lr_scale=10.0, train="")


def add_lora_flags(group) -> None:
    """--lora-rank and --lora-setting, in a script's argument group."""
    group.add_argument("--lora-rank", type=int, default=0,
                       help="r > 0: rank-r LoRA adapters on a frozen base (bf16 on GPUs); 0: every weight")
    group.add_argument("--lora-setting", action="append", default=[], metavar="NAME=VALUE",
                       help="a LoRA setting, repeatable (a later one wins): alpha (the scale is alpha / r), "
                            "dropout, targets (all-linear or names, e.g. q_proj,v_proj), lr_scale (the "
                            "adapters' learning rate over --lr), train (modules trained in full, e.g. "
                            "lm_head); the defaults: " + ", ".join(f"{k}={v}" for k, v in DEFAULTS.items()))


def peak_lr(args) -> float:
    """The learning rate the schedule warms up to: --lr, times lr_scale with LoRA."""
    return args.lr * lora_settings(args)["lr_scale"] if getattr(args, "lora_rank", 0) else args.lr


def lora_settings(args) -> dict | None:
    """What load_sharded_model's `lora` takes, from --lora-rank and --lora-setting's NAME=VALUE pairs
    over DEFAULTS; None without --lora-rank."""
    if not getattr(args, "lora_rank", 0):
        return None
    values = dict(DEFAULTS)
    for setting in args.lora_setting:
        name, _, value = setting.partition("=")
        if name not in DEFAULTS:
            raise SystemExit(f"--lora-setting {name}: not a LoRA setting\n"
                             f"---> HINT: one of {', '.join(DEFAULTS)}")
        values[name] = type(DEFAULTS[name])(value)
    targets = values["targets"] if values["targets"] == "all-linear" else values["targets"].split(",")
    return dict(r=args.lora_rank, lora_alpha=values["alpha"], lora_dropout=values["dropout"],
                target_modules=targets, seed=getattr(args, "seed", 0), lr_scale=values["lr_scale"],
                train_modules=[name for name in values["train"].split(",") if name])


def add_lora(model, settings: dict):
    """`model` (an HF causal LM, before sharding) with LoRA adapters: a peft model whose base is frozen
    and whose adapters (fp32, B = 0) and train_modules (cast to fp32) alone require gradients. A's random
    init comes from the settings' seed (the run's --seed), whatever drew random numbers before: a rerun
    starts from the same adapters."""
    from peft import LoraConfig, get_peft_model
    settings = dict(settings)
    seed, train_modules = settings.pop("seed", 0), settings.pop("train_modules", [])
    settings.pop("lr_scale", None)  # (the optimizer's: param_groups)
    config = LoraConfig(task_type="CAUSAL_LM", bias="none", **settings)
    with torch.random.fork_rng(devices=[]):  # (the process's own random stream is left as it was)
        torch.manual_seed(seed)
        model = get_peft_model(model, config, autocast_adapter_dtype=True)  # (fp32 adapters, bf16 base)
    for name, module in model.named_modules():
        if name.split(".")[-1] in train_modules:  # (in place, under the base model's names: no merge)
            module.to(torch.float32).requires_grad_(True)
    return model


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def lora_rank(model) -> int:
    """The adapters' rank; 0 for a model without."""
    return model.peft_config[ADAPTER].r if is_lora(model) else 0


def adapters_off(model):
    """A context in which `model` runs without its LoRA adapters, as the base it started from (peft's
    disable_adapter); a model without LoRA runs as it is."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def trains_adapters_only(model) -> bool:
    """Whether only LoRA adapters train: then the base, the reference policy of train.py --kl-coef, is
    the policy itself with its adapters off (infra/update.py runs it inside adapters_off: no second copy)."""
    return is_lora(model) and all(".lora_" in name for name, p in model.named_parameters() if p.requires_grad)


def hf_name(name: str) -> str:
    """A peft parameter's name in the base model: base_model.model.X.base_layer.weight -> X.weight."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _full(tensor, dtype=None):
    """The whole tensor from its FSDP2 shards (a plain tensor as it is), optionally cast first."""
    tensor = tensor.to(dtype) if dtype is not None else tensor
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@torch.no_grad()
def merged_weights(model, dtype):
    """(HF name, full tensor in `dtype`) one at a time, LoRA merged: W + (alpha / r) B A in fp32, then
    cast (the engine's bf16 weight is the rounded sum, not a sum of rounded terms). Every rank must run
    it (each gather is a collective); nothing here keeps a tensor after yielding it. A tied LM head
    appears under both names, as engine.full_weights gives it."""
    from peft.tuners.lora import LoraLayer
    scaling = {name: m.scaling[ADAPTER] for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    state = model.state_dict()
    for name, tensor in state.items():
        if ".lora_" in name:
            continue  # (merged into its base weight below)
        module = name.removesuffix(".base_layer.weight")
        if module not in scaling:
            yield hf_name(name), _full(tensor, dtype)
            continue
        a = _full(state[f"{module}.lora_A.{ADAPTER}.weight"], torch.float32)                # (r, in)
        b = _full(state[f"{module}.lora_B.{ADAPTER}.weight"], torch.float32)                # (out, r)
        weight = _full(tensor).to(torch.float32, copy=True)  # (out, in) (never the trainer's own storage)
        yield hf_name(name), weight.addmm_(b, a, alpha=scaling[module]).to(dtype)
        del a, b, weight


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters AdamW trains: the adapters (and the `train` setting's modules) with LoRA, else all."""
    return [p for p in model.parameters() if p.requires_grad]


def param_groups(model, args) -> list[dict]:
    """AdamW's parameter groups, each at its peak learning rate ("lr"): the adapters at --lr x lr_scale,
    then what is trained in full (every weight without LoRA, the `train` setting's modules with it) at
    --lr. The schedule scales each group's peak (train.py, sft.py)."""
    adapters = [p for name, p in model.named_parameters() if p.requires_grad and ".lora_" in name]
    full = [p for name, p in model.named_parameters() if p.requires_grad and ".lora_" not in name]
    groups = [dict(params=adapters, lr=peak_lr(args)), dict(params=full, lr=args.lr)]
    return [group for group in groups if group["params"]]


def describe(model) -> str:
    """'N trainable of M parameters (P%)' (a DTensor's numel is the whole tensor's)."""
    n_train = sum(p.numel() for p in trainable(model))
    n_all = sum(p.numel() for p in model.parameters())
    return f"{n_train:,} trainable of {n_all:,} parameters ({100 * n_train / n_all:.2f}%)"
