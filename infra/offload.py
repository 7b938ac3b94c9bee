"""The trainer's state in host memory while the engine rolls out, and back on the GPU for training.

With train.py --offload-trainer, which the memory plan turns on where it gives the engine the room it
needs (infra/memory_plan.py's docstring, 6), the rollout runs with these in host memory: the trainer's
fp32 shards, its buffers, AdamW's moments, and the parameters and buffers of frozen modules such as a
reference model for a KL penalty. Each tensor's storage is copied into a host buffer and freed on the
device, then reallocated and copied back, so every tensor, view and DTensor keeps its identity:
FSDP2's shards and the optimizer's keys stay valid.

Host buffers are allocated once, at their exact size, pinned once and reused every round: at 1.7B the
first offload into fresh pinned pages took 10 to 40 times the later ones (docs/gpu.md); a buffer
replaced by one of another size is unpinned first, or CUDA would refuse to register its pages again.
A tensor's host buffer is keyed by (module, kind, index): the module's place (0 the trainer's model,
then the frozen ones in order), what the tensor is ("param", "buffer", or an optimizer state such as
"exp_avg"), and its index among the module's parameters or buffers. Within one device the copies are plain copies, so a CPU run takes the same code path.
"""
import contextlib
import weakref

import torch

from infra.training import expandable_segments

# Each optimizer's {key: host buffer}, kept from round to round. A new optimizer, as after a reset, gets
# buffers of its own.
_HOST_BUFFERS = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def trainer_offloaded(model, optimizer, offload: bool = True, frozen=()):
    """The trainer's state (and `frozen` modules' weights) in host memory for the block, back on its
    device after; yields the host buffers. On every device the block runs without expandable segments,
    offloading or not: the engine wakes in it, and vLLM's sleep pools want plain segments
    (training.expandable_segments)."""
    buffers = _HOST_BUFFERS.setdefault(optimizer, {}) if offload else {}
    if offload:
        _offload(_storages(model, optimizer, frozen, buffers), buffers)
    expandable_segments(False)
    yield list(buffers.values())
    expandable_segments(True)
    if offload:
        _reload(_storages(model, optimizer, frozen, buffers), buffers)


def _local(tensor):
    """A DTensor's shard on this rank; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _storages(model, optimizer, frozen, buffers) -> dict:
    """{key: (device storage, nbytes)} of the modules' parameters and buffers and of the optimizer's
    tensors (not AdamW's step counts, which are scalars). AdamW makes its moments at its first step, after
    the first offload: their host buffers are allocated now, at the size of their parameter's shard."""
    found = {}
    for m, module in enumerate((model, *frozen)):
        for i, buffer in enumerate(module.buffers()):
            found[(m, "buffer", i)] = _local(buffer)
        for i, param in enumerate(module.parameters()):
            found[(m, "param", i)] = _local(param.data)
    for i, param in enumerate(model.parameters()):
        state = optimizer.state.get(param, {})
        for kind in [k for k, v in state.items() if torch.is_tensor(v) and v.dim()]:
            found[(0, kind, i)] = _local(state[kind])
        # A frozen weight, such as LoRA's base, never gets moments, so it gets no buffers for them.
        if not state and param.requires_grad and isinstance(optimizer, torch.optim.Adam):
            shard = found[(0, "param", i)]
            for kind in ("exp_avg", "exp_avg_sq"):
                if (0, kind, i) not in buffers:
                    buffers[(0, kind, i)] = _host_buffer(shard.numel() * shard.element_size(), shard.device)
    return {key: (t.untyped_storage(), t.untyped_storage().nbytes()) for key, t in found.items()}


def _host_buffer(nbytes: int, source):
    """`nbytes` of host memory, pinned where the source is a GPU. It is allocated pageable and registered
    at its exact size, because torch's pinned pool rounds every block up to a power of two (docs/gpu.md)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if source.type == "cuda" and nbytes:
        from torch.cuda._pin_memory_utils import pin_memory  # torch 2.13's cudaHostRegister
        pin_memory(buffer.data_ptr(), nbytes)
    return buffer


def _release(buffer, source) -> None:
    """Unpin a host buffer that _host_buffer pinned, before it is freed (torch 2.13's cudaHostUnregister)."""
    if source.type == "cuda" and buffer.numel():
        from torch.cuda._pin_memory_utils import unpin_memory
        unpin_memory(buffer.data_ptr())


def _bytes(storage):
    """A storage as a flat uint8 tensor over all of it."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _offload(storages: dict, buffers: dict) -> None:
    for key, (storage, nbytes) in storages.items():
        if key not in buffers or buffers[key].numel() != nbytes:
            if key in buffers:
                _release(buffers.pop(key), storage.device)
            buffers[key] = _host_buffer(nbytes, storage.device)
        buffers[key].copy_(_bytes(storage), non_blocking=True)
    _synchronize()  # every copy must be done before its source is freed
    for storage, _ in storages.values():
        storage.resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the freed blocks go back to the device, where the engine takes them


def _reload(storages: dict, buffers: dict) -> None:
    for key, (storage, _) in storages.items():
        storage.resize_(buffers[key].numel())
        _bytes(storage).copy_(buffers[key], non_blocking=True)
    _synchronize()  # every copy must be done before the trainer reads it


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
