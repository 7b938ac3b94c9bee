"""A real pretrained model end to end (slow): SmolLM2-135M-Instruct, a Llama with tied embeddings and a
tokenizer of its own, through the real vLLM engine, sandbox, trainer and scripts.

SmolLM2 never saw our format: from the plain prompt it writes "<tool_call>" in fewer than one turn in ten.
The multi-turn trajectories here therefore start from a prompt that holds two toy SFT conversations whose
first tool call fails and is then fixed, followed by a new toy problem; from there SmolLM2 writes a call in
about half of its first turns, and rollout.py's functions drive the turns as scheduler.rollout_lockstep does
(which starts from the plain prompt only). The in-process tests share the session's SmolLM2 engine
(conftest.py); the scripts run as commands, sft.py's checkpoint feeding train.py."""
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conversation import (CHAT_TEMPLATE, encode, format_tool_response, prompt_ids, render_messages,
                          tool_turn_pieces)
from infra.engine import model_eos_ids, turn_tokens
from rollout import FINISH_REASONS, RolloutConfig, Trajectory, add_tool_turn, end_turn, sampling_params, score
from scheduler import request_id

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
N_PROBLEMS = 16       # toy problems rolled out by SmolLM2, one trajectory each
MAX_RESPONSE = 160    # room for a call (~60 tokens), its tool turn (~40) and part of a second turn


def run(*cmd, stdin=None) -> str:
    """A script as users run it, with one torch thread (as conftest._run); its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{cmd[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def conversations_with_a_fixed_call(toy_world: Path, count: int) -> list[list[dict]]:
    """The first `count` toy SFT conversations whose first tool call fails and is fixed: the problem,
    the call, its error, the fixed call, its output, the answer."""
    with open(toy_world / "sft.jsonl") as f:
        conversations = (json.loads(line)["messages"] for line in f)
        return list(itertools.islice((c for c in conversations if len(c) == 6), count))


def tool_turns_between_sampled_turns(traj: Trajectory) -> int:
    """Runs of loss-mask-0 tokens (tool turns) with sampled tokens after them."""
    return len(re.findall("0+(?=1)", "".join("1" if m else "0" for m in traj.loss_mask)))


# -----------------------------------------------------------------------------
# Multi-turn tool trajectories sampled by SmolLM2

class Recorder:
    """The real engine, with a record of every turn it sampled: prompt ids -> (sampled ids, log-probs)."""

    def __init__(self, engine):
        self.engine, self.prompts, self.turns = engine, {}, {}

    def add_request(self, request_id, prompt, params):
        self.prompts[request_id] = tuple(prompt["prompt_token_ids"])
        self.engine.add_request(request_id, prompt, params)

    def has_unfinished_requests(self):
        return self.engine.has_unfinished_requests()

    def step(self):
        outs = self.engine.step()
        for out in outs:
            if out.finished:
                ids = list(out.outputs[0].token_ids)
                logprobs = [lp[i].logprob for i, lp in zip(ids, out.outputs[0].logprobs)]
                self.turns[self.prompts[out.request_id]] = (ids, logprobs)
        return outs


def roll_out(engine, tokenizer, sandbox, trajs, cfg) -> dict[int, list[str]]:
    """Every active trajectory's next turn, then that turn's tool calls as one sandbox batch, until all
    have finished; then the rewards. Returns per trajectory the tool outputs appended to it, in order."""
    shown = {t.index: [] for t in trajs}
    active = list(trajs)
    while active:
        for t in active:
            prompt = {"prompt_token_ids": t.prompt_ids + t.response_ids}
            engine.add_request(request_id(t), prompt, sampling_params(t, cfg, tokenizer))
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine.step() if out.finished)
        calls = []
        for t in active:
            call = end_turn(t, *turn_tokens(outputs[request_id(t)].outputs[0]), tokenizer, cfg)
            if call is not None:
                calls.append((t, call))
        results = iter(sandbox.run_batch([(c.code, c.stdin) for _, c in calls if c.error is None]))
        for t, call in calls:
            result = call.error if call.error is not None else next(results)  # an error is its own output
            before = len(t.response_ids)
            add_tool_turn(t, result, tokenizer, cfg)
            if len(t.response_ids) > before:
                if not isinstance(result, str):
                    result = format_tool_response(result, cfg.max_tool_chars)
                shown[t.index].append(result)
        active = [t for t in active if not t.finish_reason]
    score(trajs, sandbox, cfg)
    return shown


@pytest.fixture(scope="module")
def tool_trajectories(smollm2_engine, smollm2_model_dir, sandbox, toy_world):
    """Toy test problems rolled out by SmolLM2 at temperature 1.0 with the real sandbox, each from a prompt
    holding two worked conversations. Returns (trajectories, the engine's record, the tool outputs shown)."""
    tokenizer = smollm2_engine.get_tokenizer()
    shots = [m for conversation in conversations_with_a_fixed_call(toy_world, 2) for m in conversation]
    lines = (toy_world / "test.jsonl").read_text().splitlines()[:N_PROBLEMS]
    trajs = []
    for i, problem in enumerate(map(json.loads, lines)):
        ids, _ = render_messages(tokenizer, shots + [{"role": "user", "content": problem["question"]}])
        trajs.append(Trajectory(index=i, prompt_ids=ids, gold=problem["answer"]))
    eos_ids = model_eos_ids(str(smollm2_model_dir))
    cfg = RolloutConfig(deterministic=True, max_response=MAX_RESPONSE, temperature=1.0, seed=1, eos_ids=eos_ids)
    engine = Recorder(smollm2_engine.llm_engine)
    shown = roll_out(engine, tokenizer, sandbox, trajs, cfg)
    return trajs, engine, shown


def test_trainer_logprobs_equal_vllm_on_every_sampled_token_of_multi_turn_tool_trajectories(
        tool_trajectories, smollm2_model_dir):
    from transformers import AutoModelForCausalLM
    from infra.logprobs import token_logprobs
    trajs, _, _ = tool_trajectories
    multi = [t for t in trajs if tool_turns_between_sampled_turns(t)]
    assert len(multi) >= 3, (f"only {len(multi)}/{len(trajs)} trajectories have a tool turn between sampled "
                             f"turns: SmolLM2 stopped imitating the worked conversations' tool calls")
    model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir, dtype=torch.float32)
    worst = 0.0
    for t in multi[:4]:  # (each is a forward pass over ~1,300 tokens)
        ids = torch.tensor([t.prompt_ids.tolist() + t.response_ids.tolist()])             # (1, T)
        with torch.no_grad():
            logp = token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)        # (1, T-1)
        trainer = logp[0, len(t.prompt_ids) - 1:]                                         # (R,)
        sampled_tokens = torch.tensor(t.loss_mask, dtype=torch.bool)                      # (R,)
        worst = max(worst, (trainer - torch.tensor(t.logprobs))[sampled_tokens].abs().max().item())
    assert worst <= 1e-4, (f"the trainer's fp32 log-probs differ from vLLM's on SmolLM2's sampled tokens by "
                           f"{worst:.2e}: the engine does not sample from the model the trainer scores")


def test_trajectory_ids_are_the_prompt_then_exactly_the_sampled_ids_and_the_encoded_tool_turns(
        tool_trajectories, smollm2_engine):
    tokenizer = smollm2_engine.get_tokenizer()
    trajs, engine, shown = tool_trajectories
    for t in trajs:
        # Rebuilt from the engine's outputs and the tool outputs alone: each turn the engine sampled for
        # the ids so far, then the tool turn of the output shown after it.
        ids, loss_mask, logprobs, turns, prompt = [], [], [], 0, t.prompt_ids.tolist()
        outputs = iter(shown[t.index])
        while tuple(prompt + ids) in engine.turns:
            turn_ids, turn_logprobs = engine.turns[tuple(prompt + ids)]
            ids += turn_ids
            loss_mask += [1] * len(turn_ids)
            logprobs += turn_logprobs
            turns += 1
            output = next(outputs, None)
            if output is not None:
                tool_ids = encode(tokenizer, tool_turn_pieces(output))
                ids += tool_ids
                loss_mask += [0] * len(tool_ids)
                logprobs += [0.0] * len(tool_ids)
        where = f"trajectory {t.index} ({t.num_turns} turns, {t.finish_reason})"
        assert t.response_ids.tolist() == ids, \
            f"{where}: the trainer's ids are not the prompt + the sampled ids + the encoded tool turns"
        assert t.loss_mask.tolist() == loss_mask, \
            f"{where}: loss mask is not 1 on sampled tokens and 0 on tool tokens"
        assert t.logprobs.tolist() == logprobs, f"{where}: log-probs are not the sampler's, and 0.0 on tool tokens"
        assert turns == t.num_turns, f"{where}: {turns} engine turns rebuilt, {t.num_turns} counted"
        assert t.finish_reason in FINISH_REASONS
    assert sum(tool_turns_between_sampled_turns(t) for t in trajs) >= 3, "too few tool turns to check"


# -----------------------------------------------------------------------------
# Weight sync with tied embeddings

def greedy(llm, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """12 greedy tokens per prompt, with their log-probs."""
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    samples = []
    for out in outs:
        ids = list(out.outputs[0].token_ids)
        samples.append((ids, [lp[i].logprob for i, lp in zip(ids, out.outputs[0].logprobs)]))
    return samples


def max_logprob_diff(model, prompts, samples) -> float:
    """Largest difference between the HF model's log-probs of the sampled tokens and the engine's."""
    from infra.logprobs import token_logprobs
    worst = 0.0
    for prompt, (ids, logprobs) in zip(prompts, samples):
        x = torch.tensor([prompt + ids])                                                  # (1, T)
        with torch.no_grad():
            hf = token_logprobs(model, x, torch.ones_like(x))[0, len(prompt) - 1:]        # (len(ids),)
        worst = max(worst, (hf - torch.tensor(logprobs)).abs().max().item())
    return worst


def test_weight_sync_of_tied_embeddings_changes_the_samples_and_syncing_back_restores_them(
        smollm2_engine, smollm2_model_dir, toy_world):
    from transformers import AutoModelForCausalLM
    from infra.engine import sync_weights
    from infra.engine import full_weights
    tokenizer = smollm2_engine.get_tokenizer()
    lines = (toy_world / "test.jsonl").read_text().splitlines()[:3]
    prompts = [prompt_ids(tokenizer, json.loads(line)["question"]) for line in lines]
    model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir, dtype=torch.float32)
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embed, "SmolLM2's head must be its input embedding"
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    before = greedy(smollm2_engine, prompts)
    torch.manual_seed(0)
    with torch.no_grad():
        embed.add_(0.5 * embed.std() * torch.randn_like(embed))  # the head moves with it
    try:
        sync_weights(smollm2_engine, full_weights(model, torch.float32))  # what train.py sends
        after = greedy(smollm2_engine, prompts)
        assert [ids for ids, _ in after] != [ids for ids, _ in before], \
            "the greedy samples did not change: the perturbed weights never reached the engine"
        worst = max_logprob_diff(model, prompts, after)
        assert worst <= 1e-4, (f"after the sync vLLM's log-probs differ from the perturbed model's by "
                               f"{worst:.2e}: its input embedding or its tied head kept the old weights")
    finally:
        sync_weights(smollm2_engine, iter(original.items()))
    restored = greedy(smollm2_engine, prompts)
    assert [ids for ids, _ in restored] == [ids for ids, _ in before], \
        "syncing the original weights back must give the original greedy samples"


# -----------------------------------------------------------------------------
# eval.py on SmolLM2 (in process, on the shared engine)

def test_eval_of_smollm2_writes_a_table_and_samples_that_agree(smollm2_engine, smollm2_model_dir,
                                                                 toy_world, tmp_path):
    from eval import main
    lines = (toy_world / "test.jsonl").read_text().splitlines()[:4]
    (tmp_path / "toy.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "results"
    main(["--model", str(smollm2_model_dir), "--benchmarks", str(tmp_path / "toy.jsonl"), "--n", "1",
          "--max-response", "64", "--max-turns", "2", "--tool-workers", "1", "--out-dir", str(out)],
         llm=smollm2_engine)
    (row,) = json.loads((out / "table.json").read_text())["table"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert (row["benchmark"], row["problems"], row["samples"], len(samples)) == ("toy", 4, 4, 4)
    assert [s["gold"] for s in samples] == [json.loads(line)["answer"] for line in lines], \
        "samples must map back to their own problems, in order"
    assert all(s["text"] and s["finish_reason"] in FINISH_REASONS for s in samples)
    assert all(0 < s["response_tokens"] <= 64 for s in samples), "the response budget was not kept"
    assert 0.0 <= row["avg_pass@1"] <= 1.0
    assert row["avg_pass@1"] == pytest.approx(sum(s["correct"] for s in samples) / 4), \
        "avg pass@1 must be the share of correct samples"
    assert row["response_length"] == pytest.approx(sum(s["response_tokens"] for s in samples) / 4)
    assert json.loads((out / "eval_config.json").read_text())["max_response"] == 64


# -----------------------------------------------------------------------------
# sft.py -> train.py on SmolLM2, as commands

@pytest.fixture(scope="module")
def smollm2_sft(tmp_path_factory, smollm2_model_dir, toy_world) -> Path:
    """sft.py from SmolLM2: 2 steps of one toy tool conversation each (~600 tokens: ~12 s a step on one
    thread). The checkpoint folder."""
    out = tmp_path_factory.mktemp("smollm2-sft")
    with open(toy_world / "sft.jsonl") as f:
        tool_conversations = (line for line in f if '"tool_call"' in line)
        (out / "sft.jsonl").write_text("".join(itertools.islice(tool_conversations, 2)))
    run("sft.py", "--model", smollm2_model_dir, "--data", out / "sft.jsonl", "--out-dir", out / "model",
        "--max-steps", "2", "--batch-size", "1", "--max-len", "1024", "--micro-batch-tokens", "1024",
        "--lr", "1e-5", "--grad-checkpointing", "0", "--threads", "1")
    return out / "model"


def test_sft_checkpoint_of_smollm2_renders_our_format_through_its_chat_template(
        smollm2_sft, smollm2_model_dir, toy_world):
    from transformers import AutoConfig, AutoTokenizer
    assert AutoTokenizer.from_pretrained(smollm2_model_dir).chat_template != CHAT_TEMPLATE, \
        "SmolLM2 must come with a chat template of its own, or this test shows nothing"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_sft)
    assert tokenizer.chat_template == CHAT_TEMPLATE, "sft.py must save the project's chat template"
    (conversation,) = conversations_with_a_fixed_call(toy_world, 1)
    ids, _ = render_messages(tokenizer, conversation)
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == tokenizer.decode(ids), \
        "apply_chat_template must render a conversation as render_messages does"
    ids, _ = render_messages(tokenizer, conversation[:3])  # up to a tool turn: the next assistant turn opened
    rendered = tokenizer.apply_chat_template(conversation[:3], tokenize=False, add_generation_prompt=True)
    assert rendered == tokenizer.decode(ids), \
        "the generation prompt must open the assistant turn as a rollout does"
    rows = [json.loads(line) for line in (smollm2_sft / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
    config = AutoConfig.from_pretrained(smollm2_sft)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings, \
        "the checkpoint must stay a Llama with tied embeddings"


def test_train_two_steps_from_the_sft_checkpoint_then_a_resumed_run_starts_at_step_3(
        smollm2_sft, toy_world, tmp_path):
    # SmolLM2 solves none of these, so every group is dropped and the steps change no weight: this guards
    # the run itself (FSDP2 on a tied Llama, its engine on sft.py's checkpoint, checkpoints and resume).
    data = tmp_path / "problems.jsonl"
    data.write_text("\n".join((toy_world / "train.jsonl").read_text().splitlines()[:4]) + "\n")
    out = tmp_path / "rl"
    flags = ["train.py", "--model", smollm2_sft, "--data", data, "--out-dir", out,
             "--problems-per-step", "2", "--rollouts-per-problem", "2", "--group-size", "2",
             "--max-response", "48", "--max-prompt", "512", "--max-turns", "2", "--kv-cache-tokens", "4096",
             "--lr", "1e-5", "--warmup-steps", "0", "--save-every", "2"]
    run(*flags, "--steps", "2")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["response_length"] > 0 for r in rows), "vLLM did not sample from sft.py's checkpoint"
    assert (out / "checkpoints" / "step_2" / "meta.json").exists(), "the last step must be checkpointed"
    printed = run(*flags, "--steps", "3")  # (the same --out-dir: it goes on from its checkpoint)
    assert "resumed from" in printed and "step_2: step 2" in printed, \
        f"the second run did not resume from the step-2 checkpoint:\n{printed[-2000:]}"
    steps_run = re.findall(r"^step +(\d+)/3 ", printed, re.M)
    assert steps_run == ["3"], f"the resumed run must run step 3 only, ran {steps_run}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3], "the resumed run must append step 3 to the log"
    assert (out / "checkpoints" / "step_3" / "meta.json").exists()
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2", "step_3"], "the newest three are kept"
    from transformers import AutoConfig, AutoTokenizer
    assert AutoConfig.from_pretrained(out / "final").tie_word_embeddings, "the export untied the embeddings"
    assert AutoTokenizer.from_pretrained(out / "final").chat_template == CHAT_TEMPLATE


# -----------------------------------------------------------------------------
# chat.py on the toy model, its input scripted

def test_chat_shows_the_tool_call_its_output_and_the_answer_then_exits_at_end_of_input(toy_sft_model):
    # The toy SFT data solves half its problems in the head, so whether a greedy model calls the tool on one
    # problem turns on rounding that differs between CPUs: six problems make a call all but certain.
    pairs = [(1234, 5678), (4321, 8765), (2468, 1357), (9876, 5432), (3141, 5926), (2718, 2818)]
    printed = run("chat.py", "--model", toy_sft_model, "--temperature", "0", "--kv-cache-tokens", "8192",
                  stdin="".join(f"What is {a} * {b}?\n" for a, b in pairs))
    answers = re.findall(r"^answer: \S+", printed, re.M)
    assert len(answers) == len(pairs), f"not one answer line a problem:\n{printed}"
    called = [(a, b) for a, b in pairs if f"print({a} * {b})" in printed]
    assert called and "<tool_call>" in printed, f"no tool call shown in {len(pairs)} problems:\n{printed}"
    for a, b in called:
        shown = f"tool (ok):\n{a * b}\n" in printed
        assert shown, f"the sandbox's output of {a} * {b} is not shown:\n{printed}"
