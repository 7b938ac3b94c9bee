"""Where a batch's tokens live: every rank gets every trajectory's numbers (ProblemQueue.gather) and
the tokens of the trajectories it trains on (batch.exchange), from the rank that rolled them out."""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import torchrun
from rollout import Trajectory, trajectory_metrics
from infra.batch import ProblemQueue, exchange, without_payload

ROOT = Path(__file__).resolve().parent.parent
PROBLEMS, SAMPLES = 6, 4


def rolled_out(index: int, sample: int) -> Trajectory:
    """A finished trajectory whose tokens follow from (index, sample) alone, lengths and masks varied."""
    rng = np.random.default_rng(100 * index + sample)
    n_prompt, n_response = 5 + index, 10 + 7 * sample + 3 * index
    mask = rng.random(n_response) < 0.7
    return Trajectory(index=index, sample=sample, prompt_ids=rng.integers(0, 150_000, n_prompt, dtype=np.int32),
                      response_ids=rng.integers(0, 150_000, n_response, dtype=np.int32), loss_mask=mask,
                      logprobs=np.where(mask, -rng.random(n_response), 0.0).astype(np.float32),
                      num_turns=1 + sample % 3, tool_calls=sample % 3, tool_failures={"error": index % 2},
                      reward=float(sample % 2), text=f"response {index}/{sample}")


def same_tokens(a: Trajectory, b: Trajectory) -> bool:
    return all(getattr(a, k).dtype == getattr(b, k).dtype and np.array_equal(getattr(a, k), getattr(b, k))
               for k in ("prompt_ids", "response_ids", "loss_mask", "logprobs"))


def plan_of(kept: list[Trajectory], world_size: int) -> list:
    """Who trains what, as train.py plans it: the micro-batch plan over the kept trajectories' lengths."""
    from infra.batch import plan_micro_batches
    return plan_micro_batches([t.prompt_length + t.response_length for t in kept], 64, world_size)


def trainers_of(kept: list[Trajectory], world_size: int) -> list[int]:
    """The rank each of `kept` is trained on, by the plan."""
    return [next(r for r, batches in enumerate(plan_of(kept, world_size)) if any(i in b for b in batches))
            for i in range(len(kept))]


def test_one_rank_gathers_and_exchanges_nothing():
    """A group of one takes the same calls and gets its own objects back, untouched."""
    trajs = [rolled_out(i, s) for i in range(PROBLEMS) for s in range(SAMPLES)]
    queue = ProblemQueue()
    gathered = queue.gather(trajs)
    kept = exchange(gathered, plan_of(gathered, 1))
    assert all(a is b for a, b in zip(kept, trajs)) and len(kept) == len(trajs)
    with pytest.raises(RuntimeError, match="HINT"):  # tokens that no rank holds
        exchange([without_payload(trajs[0])], [[[0]]])


def test_a_trajectorys_numbers_are_small_and_read_like_its_own():
    """What every rank receives of another's trajectory: the same numbers and lengths, in bytes that do
    not grow with its tokens (an 8K-token trajectory's numbers cost what a 20-token one's do)."""
    short, long = rolled_out(0, 0), rolled_out(1, 1)
    n = 8192
    long.response_ids, long.logprobs = np.arange(n, dtype=np.int32), np.zeros(n, np.float32)
    long.loss_mask = np.arange(n) % 3 > 0
    numbers = without_payload(long)
    assert (numbers.prompt_ids, numbers.response_ids, numbers.loss_mask, numbers.logprobs, numbers.text) == \
           (None,) * 5
    assert (numbers.prompt_length, numbers.response_length, numbers.num_loss_tokens) == \
           (len(long.prompt_ids), n, int(long.loss_mask.sum()))
    assert trajectory_metrics([numbers, without_payload(short)]) == trajectory_metrics([long, short])
    assert without_payload(long, with_text=True).text == long.text
    size = len(pickle.dumps(numbers))
    assert size < 1000 and abs(size - len(pickle.dumps(without_payload(short)))) < 32, \
        f"a trajectory's numbers take {size} bytes"


@pytest.mark.slow
def test_two_ranks_receive_exactly_the_tokens_they_train_on(tmp_path):
    """torchrun, two gloo ranks. Rank r rolls out the problems with index % 2 == r; after the gather
    every rank holds every trajectory's numbers and only its own tokens and text; a down-sampled
    subset is planned into micro-batches, and after the exchange each rank holds the tokens (equal to
    the originals, dtypes included) of exactly the trajectories it trains, and of no other."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [*torchrun(2), __file__, str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    every = [[i, s] for i in range(PROBLEMS) for s in range(SAMPLES)]
    for rank, result in enumerate(ranks):
        assert result["gathered"] == every, "every rank must get every trajectory's numbers, in problem order"
        assert result["numbers_equal"], "the numbers another rank receives must be the roller's"
        assert result["held"] == [key for key in every if key[0] % 2 == rank], \
            "after the gather a rank must hold the tokens and text of its own rollouts only"
        assert result["rolled_here"] == result["held"], "a trajectory's rank must name the rank that rolled it out"
    kept = [key for key in every if sum(key) % 3]
    trainers = trainers_of([rolled_out(*key) for key in kept], 2)
    assert sorted(set(trainers)) == [0, 1] and any(t != key[0] % 2 for t, key in zip(trainers, kept)), \
        "the test needs trajectories that move between ranks"
    for rank, result in enumerate(ranks):
        assert result["kept"] == kept
        assert result["with_tokens"] == [key for key, r in zip(kept, trainers) if r == rank], \
            f"rank {rank} must hold the tokens of exactly the trajectories it trains"
        assert result["tokens_equal"], f"rank {rank} received tokens that differ from the rolled-out ones"


def _rank_main(out: str):
    """One rank of the test above (run by torchrun)."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    queue = ProblemQueue("exchange-test", distributed=True, group=dist.group.WORLD)
    mine = [rolled_out(i, s) for i in range(PROBLEMS) if i % world_size == rank for s in range(SAMPLES)]
    gathered = sorted(queue.gather(mine), key=lambda t: (t.index, t.sample))
    numbers_equal = all(trajectory_metrics([t]) == trajectory_metrics([rolled_out(t.index, t.sample)])
                        and t.prompt_length == rolled_out(t.index, t.sample).prompt_length for t in gathered)
    held = [[t.index, t.sample] for t in gathered if t.response_ids is not None and t.text is not None]
    kept = [t for t in gathered if (t.index + t.sample) % 3]      # what down-sampling kept
    kept = exchange(kept, plan_of(kept, world_size), queue.group)
    with_tokens = [t for t in kept if t.response_ids is not None]
    result = {"gathered": [[t.index, t.sample] for t in gathered], "numbers_equal": numbers_equal,
              "held": held, "rolled_here": [[t.index, t.sample] for t in gathered if t.rank == rank],
              "kept": [[t.index, t.sample] for t in kept],
              "with_tokens": [[t.index, t.sample] for t in with_tokens],
              "tokens_equal": all(same_tokens(t, rolled_out(t.index, t.sample)) for t in with_tokens)}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()  # no rank tears gloo down while the other may still be talking to it
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
