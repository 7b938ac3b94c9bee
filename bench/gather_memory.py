"""What a rank receives and holds of a step's rollouts, before and after the payload split, at the paper's
scale: 512 problems x 32 rollouts = 16,384 trajectories of 8K response tokens, 8 ranks, G = 16 kept.

before: every rank all_gather_object's every trajectory, tokens as Python lists (the gather train.py had).
after:  ProblemQueue.gather sends every rank the numbers of every trajectory (the tokens stay, as numpy
        arrays, with the rank that rolled them out); ProblemQueue.exchange then sends each rank the tokens
        of the kept trajectories its micro-batches hold.

Eight ranks of 11 GB do not fit in this machine, so:
1. Measured, in one process, on real objects: the bytes one trajectory takes pickled (what the collectives
   carry) and in memory once unpickled (tracemalloc: Python objects and numpy buffers), for each thing a
   rank receives or holds. The synthetic trajectories are built as rollout.py builds them (turns of fresh
   ids and log-probs, tool turns of mask 0 and log-prob 0.0, the decoded text alongside, 4 characters a
   token; ids uniform over Qwen's vocabulary), then scored by rollout.score (which makes the arrays).
2. Counted at full scale, with the real planning code on the real lengths: which rank trains which kept
   trajectory (batch.plan_micro_batches) and how many of those another rank rolled out.
3. Extrapolated: 1 x 2, linearly (every trajectory has the same length, so the costs are per trajectory).
4. Checked on a real 2-rank gloo run of both protocols (a smaller batch): the bytes the collectives
   deliver to each rank, counted at the collectives, and what each rank holds afterwards, against the
   model of 1-3 at that scale.

    python bench/gather_memory.py [--trajectories 64] [--gloo-trajectories 64]

The last line is the ratio: `gather: X x fewer bytes received per rank, Y x less resident memory per rank`.
"""
import argparse
import gc
import os
import pickle
import sys
import tempfile
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project root
from rollout import RolloutConfig, Trajectory, score  # noqa: E402
from infra.batch import ProblemQueue, exchange, without_payload  # noqa: E402
from infra.batch import plan_micro_batches  # noqa: E402

VOCAB = 151_643  # Qwen's vocabulary
GiB, MiB = 2**30, 2**20


def rolled_out(index: int, sample: int, prompt: int, response: int) -> Trajectory:
    """A finished trajectory as rollout.end_turn and add_tool_turn build it, from a seed of its own:
    sampled turns of 200-1,500 tokens, tool turns of 30-400, up to `response` tokens."""
    rng = np.random.default_rng(1000 * index + sample)
    t = Trajectory(index=index, sample=sample, prompt_ids=rng.integers(0, VOCAB, prompt).tolist(), gold="42")
    while len(t.response_ids) < response:
        n = int(min(rng.integers(200, 1500), response - len(t.response_ids)))
        t.response_ids += rng.integers(0, VOCAB, n).tolist()  # (fresh ints, as the engine returns them)
        t.loss_mask += [1] * n
        t.logprobs += (-rng.exponential(0.5, n)).tolist()
        t.text += rng.integers(97, 123, 4 * n, dtype=np.uint8).tobytes().decode()
        t.num_turns += 1
        tool = int(min(rng.integers(30, 400), response - len(t.response_ids)))
        if tool:
            t.response_ids += rng.integers(0, VOCAB, tool).tolist()
            t.loss_mask += [0] * tool
            t.logprobs += [0.0] * tool
            t.text += rng.integers(97, 123, 4 * tool, dtype=np.uint8).tobytes().decode()
            t.tool_calls += 1
            t.tool_failures["error"] = t.tool_failures.get("error", 0) + int(rng.random() < 0.2)
    t.answer, t.num_answers, t.finish_reason = ("42", 1, "answer") if sample % 2 else (None, 0, "length")
    return t


def held(make):
    """(make(), the bytes its result holds: every allocation made by make() and still alive)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    result = make()
    gc.collect()
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return result, size


def tokens_of(t) -> tuple:
    """What ProblemQueue.exchange sends of a trajectory: its key and its token arrays."""
    return (t.index, t.sample), [t.prompt_ids, t.response_ids, t.loss_mask, t.logprobs]


# -----------------------------------------------------------------------------
# 1. per-trajectory costs, measured on real objects

def per_trajectory(count: int, prompt: int, response: int) -> dict:
    """Bytes per trajectory, pickled ("bytes") and held once unpickled ("memory"), of each thing sent."""
    as_lists = [rolled_out(i, 0, prompt, response) for i in range(count)]
    for t in as_lists:
        t.correct = t.answer == t.gold  # (today's score(): the same numbers, the tokens left as lists)
        t.reward = float(t.correct and t.finish_reason != "length")
    as_arrays = [rolled_out(i, 0, prompt, response) for i in range(count)]
    score(as_arrays, sandbox=None, cfg=RolloutConfig())
    sent = {"lists": as_lists, "arrays": as_arrays, "numbers": [without_payload(t) for t in as_arrays],
            "tokens": [tokens_of(t) for t in as_arrays]}
    costs = {}
    for name, objects in sent.items():
        blob = pickle.dumps(objects)
        _, memory = held(lambda: pickle.loads(blob))
        costs[name] = {"bytes": len(blob) / count, "memory": memory / count}
    return costs


# -----------------------------------------------------------------------------
# 2. who trains what at full scale: the real plan on the real lengths

def who_trains(problems: int, group_size: int, ranks: int, length: int, budget: int) -> list[dict]:
    """Per rank: the kept trajectories it trains, how many of those another rank rolled out (it receives
    their tokens), and how many of its own another rank trains (it sends them). Problems go to ranks in
    turn (the scheduler's shared counter spreads them about so); down-sampling keeps G of each problem's
    rollouts and drops no group (the most that can move)."""
    holder = [p % ranks for p in range(problems) for _ in range(group_size)]
    return plan_counts(plan_micro_batches([length] * len(holder), budget, ranks), holder)


def plan_counts(plan: list, holder: list[int]) -> list[dict]:
    """Per rank of a plan_micro_batches plan: trained, received and sent, holder[i] the rank that holds i."""
    trainer = {i: rank for rank, batches in enumerate(plan) for batch in batches for i in batch}
    return [{"trained": sum(r == rank for r in trainer.values()),
             "received": sum(r == rank != holder[i] for i, r in trainer.items()),
             "sent": sum(holder[i] == rank != r for i, r in trainer.items())} for rank in range(len(plan))]


def model(costs: dict, n: int, ranks: int, counts: dict) -> dict:
    """Bytes received and held per rank for the batch, before and after. Held: after the gather (before);
    after the exchange (after): the rank's own rollouts whole, the others' numbers, the tokens it received
    (in a new record each), and the numbers-only copies it makes of its own rollouts that others train."""
    own, others = n // ranks, n - n // ranks
    numbers, tokens = costs["numbers"], costs["tokens"]
    return {
        "before": {"received": others * costs["lists"]["bytes"], "held": n * costs["lists"]["memory"]},
        "after": {"received": others * numbers["bytes"] + counts["received"] * tokens["bytes"],
                  "held": own * costs["arrays"]["memory"] + others * numbers["memory"]
                  + counts["received"] * (tokens["memory"] + numbers["memory"])
                  + counts["sent"] * numbers["memory"]}}


# -----------------------------------------------------------------------------
# 4. a real 2-rank gloo run of both protocols

def gloo_rank(rank: int, world: int, init: str, count: int, prompt: int, response: int, out: str):
    """One rank: roll out `count` trajectories (8 per problem, problems dealt in turn), then today's
    gather, then the new gather and exchange; the bytes the collectives deliver from the other ranks
    are counted at the collectives, what the results hold with tracemalloc."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    received = [0]
    all_gather, all_to_all_single = c10d.all_gather, dist.all_to_all_single

    def counting_all_gather(outputs, tensor, group=None, async_op=False):  # (inside all_gather_object)
        received[0] += sum(x.numel() * x.element_size() for r, x in enumerate(outputs) if r != rank)
        return all_gather(outputs, tensor, group=group, async_op=async_op)

    def counting_all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, **kw):
        splits = output_split_sizes or [output.numel() // world] * world
        received[0] += sum(s for r, s in enumerate(splits) if r != rank) * output.element_size()
        return all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, **kw)

    c10d.all_gather, dist.all_to_all_single = counting_all_gather, counting_all_to_all_single
    problems = [p for p in range(count * world // 8) if p % world == rank]

    def before():  # the rank's rollouts as lists, every one to every rank
        mine = [rolled_out(p, s, prompt, response) for p in problems for s in range(8)]
        parts = [None] * world
        dist.all_gather_object(parts, mine)
        return parts

    def after():  # as arrays: the numbers to every rank, then the tokens of what each rank trains
        mine = [rolled_out(p, s, prompt, response) for p in problems for s in range(8)]
        score(mine, sandbox=None, cfg=RolloutConfig())
        queue = ProblemQueue("bench", distributed=True)
        trajs = sorted(queue.gather(mine), key=lambda t: (t.index, t.sample))
        kept = [t for t in trajs if t.sample % 2]  # G of 2G
        plan = plan_micro_batches([t.prompt_length + t.response_length for t in kept], prompt + response, world)
        counts = plan_counts(plan, [t.index % world for t in kept])[rank]
        return trajs, exchange(kept, plan), counts

    result = {}
    for name, protocol in (("before", before), ("after", after)):
        received[0] = 0
        dist.barrier()
        value, memory = held(protocol)
        result[name] = {"received": received[0], "held": memory}
    result["counts"] = value[2]
    with open(f"{out}/rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    dist.barrier()  # no rank tears gloo down while the other may still be talking to it
    dist.destroy_process_group()



def main():
    parser = argparse.ArgumentParser(description="bytes received and memory held per rank, before and after")
    parser.add_argument("--problems", type=int, default=512)
    parser.add_argument("--rollouts", type=int, default=32, help="2G")
    parser.add_argument("--group-size", type=int, default=16, help="G")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=300, help="prompt tokens")
    parser.add_argument("--response", type=int, default=8192, help="response tokens")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="train.py's default")
    parser.add_argument("--trajectories", type=int, default=64, help="measured per kind in step 1")
    parser.add_argument("--gloo-trajectories", type=int, default=64, help="per rank in step 4 (0: skip it)")
    args = parser.parse_args()
    n = args.problems * args.rollouts
    length = args.prompt + args.response

    costs = per_trajectory(args.trajectories, args.prompt, args.response)
    print(f"1. measured per trajectory ({args.prompt} + {args.response} tokens, {args.trajectories} of each):")
    for name, what in [("lists", "whole, tokens as lists (before)"),
                       ("arrays", "whole, tokens as arrays"),
                       ("numbers", "numbers only (after: gather)"),
                       ("tokens", "token arrays (after: exchange)")]:
        print(f"   {what:34s} {costs[name]['bytes'] / 1024:8.1f} KiB pickled, "
              f"{costs[name]['memory'] / 1024:8.1f} KiB in memory")

    counts = max(who_trains(args.problems, args.group_size, args.ranks, length, args.micro_batch_tokens),
                 key=lambda c: c["received"])
    print(f"2. counted: {n} trajectories on {args.ranks} ranks, {args.problems * args.group_size} kept; the "
          f"rank that receives the most trains {counts['trained']}, {counts['received']} of them rolled out "
          f"elsewhere, and sends {counts['sent']}")

    rows = model(costs, n, args.ranks, counts)
    print("3. extrapolated, per rank:")
    for when in ("before", "after"):
        print(f"   {when:6s}: receives {rows[when]['received'] / GiB:6.2f} GiB, "
              f"holds {rows[when]['held'] / GiB:6.2f} GiB for the batch")
    rolling = n // args.ranks * costs["lists"]["memory"]  # (a rank's own rollouts are lists until scored)
    print(f"   both hold a rank's own rollouts as lists until they are scored ({rolling / GiB:.2f} GiB); "
          f"the peak of a step, that included, is {(rolling + rows['before']['held']) / GiB:.2f} GiB before "
          f"(the own lists and the gathered copies), {max(rolling, rows['after']['held']) / GiB:.2f} GiB after")

    if args.gloo_trajectories:
        import torch.multiprocessing as mp
        world, count = 2, args.gloo_trajectories
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(gloo_rank, args=(world, f"file://{out}/store", count, args.prompt, args.response, out),
                     nprocs=world)
            ranks = []
            for r in range(world):
                with open(f"{out}/rank{r}.pkl", "rb") as f:
                    ranks.append(pickle.load(f))
        print(f"4. real gloo run, {world} ranks x {count} trajectories (measured | the model of 1-3):")
        for r, result in enumerate(ranks):
            expected = model(costs, world * count, world, result["counts"])
            for when in ("before", "after"):
                got, want = result[when], expected[when]
                print(f"   rank {r} {when:6s}: receives {got['received'] / MiB:7.1f} | "
                      f"{want['received'] / MiB:7.1f} MiB, holds {got['held'] / MiB:7.1f} | "
                      f"{want['held'] / MiB:7.1f} MiB")

    fewer_bytes = rows["before"]["received"] / rows["after"]["received"]
    less_memory = rows["before"]["held"] / rows["after"]["held"]
    print(f"gather: {fewer_bytes:.1f} x fewer bytes received per rank, "
          f"{less_memory:.1f} x less resident memory per rank")


if __name__ == "__main__":
    main()
