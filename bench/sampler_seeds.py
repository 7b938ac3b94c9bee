"""Benchmark: what a seed per request costs vLLM's sampler (rollout.RolloutConfig.deterministic).

    python bench/sampler_seeds.py --model runs/toy_sft
    python bench/sampler_seeds.py --model DIR --batch 512 --tokens 64 --rounds 3

vLLM 0.32 samples the requests that carry a seed of their own one by one (a Python loop per decode
step: vllm/v1/sample/ops/topk_topp_sampler.py), the others in one batched draw. This runs the same
batch of prompts through one engine (engine.make_engine) with and without per-request seeds, each
request decoding exactly --tokens tokens (ignore_eos), and times the decode steps. The rounds
alternate the two arms so that the machine's load falls on both. Last line:
`sampler seeds: <x> ms per decode step without, <y> with: <ratio> x slower with a seed per request`.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from conversation import prompt_ids  # noqa: E402
from infra.engine import make_engine  # noqa: E402

parser = argparse.ArgumentParser(description="Decode-step time with and without a seed per request.")
parser.add_argument("--model", required=True, help="HF model folder (the toy SFT model, SmolLM2, ...)")
parser.add_argument("--batch", type=int, default=256, help="requests decoded at once")
parser.add_argument("--tokens", type=int, default=64, help="tokens each request decodes")
parser.add_argument("--rounds", type=int, default=3, help="timed rounds per arm (alternating)")
args = parser.parse_args()

from transformers import AutoTokenizer  # noqa: E402
from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(args.model)
prompts = [prompt_ids(tokenizer, f"What is {1000 + i} * {2000 + 7 * i}?") for i in range(args.batch)]
longest = max(map(len, prompts)) + args.tokens
llm = make_engine(args.model, max_model_len=longest, kv_cache_tokens=args.batch * longest)
engine = llm.llm_engine


def decode_step_ms(seeded: bool, round_: int) -> float:
    """The batch decoded together; the mean wall time of the engine steps once all are decoding."""
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0,
                                seed=round_ * args.batch + i if seeded else None, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"{round_}-{seeded}-{i}", {"prompt_token_ids": ids}, params)
    engine.step()  # the prefill of every prompt (not timed)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


decode_step_ms(False, -1)  # warm-up
ms = {False: [], True: []}
for r in range(args.rounds):
    for seeded in (False, True):
        ms[seeded].append(decode_step_ms(seeded, r))
        print(f"round {r}: {'seeded  ' if seeded else 'unseeded'} {ms[seeded][-1]:7.2f} ms per decode step "
              f"(batch {args.batch}, 1-min load {os.getloadavg()[0]:.1f})", flush=True)
without, with_ = min(ms[False]), min(ms[True])
print(f"sampler seeds: {without:.2f} ms per decode step without, {with_:.2f} with: "
      f"{with_ / without:.2f} x slower with a seed per request")
