"""The plumbing under the paper's files: what the scripts at the root need and a reader opens only by choice.

- update.py: the policy update's micro-batches across ranks, the old and reference log-probs, empty passes
- batch.py: the problem stream, micro-batch planning, the trajectories across ranks, rollout timing
- logprobs.py: token log-probs in chunks, packing, the shared prompt prefix
- training.py: the process group, FSDP2 loading (LoRA through peft), checkpoints, the collapse alarm
- engine.py: every vLLM detail (start, weight sync, sleep and wake)
- offload.py: the trainer's state in host memory while the engine is awake
- lora.py: peft adapters, merged for the engine and the export
- memory_plan.py: the GPU memory of every phase, from the model's config
- isolation.py: the kernel's walls around a sandbox call (namespaces, Landlock, seccomp, a memory cgroup)
"""
