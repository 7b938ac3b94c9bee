"""Multi-turn tool rollouts: the conversation format and the agent loop.

(The conversation format and the agent loop are filled in below; the
`Trajectory` record is the contract every other file reads.)
"""
from dataclasses import dataclass, field

# -----------------------------------------------------------------------------
# The trajectory record (DESIGN.md §4): everything downstream reads only this.

FAILURE_KINDS = ("error", "timeout", "oom", "parse")  # what counts as a failed tool call


@dataclass
class Trajectory:
    index: int                      # which problem of the batch (rollouts of one problem share it)
    prompt_ids: list[int]           # the rendered prompt, ending with the assistant turn opened by <reason>
    response_ids: list[int] = field(default_factory=list)  # sampled turns + tool turns, in order
    loss_mask: list[int] = field(default_factory=list)     # 1 = sampled by the policy, 0 = tool/template
    logprobs: list[float] = field(default_factory=list)    # sampler log-prob per response token (0.0 where mask is 0)
    num_turns: int = 0              # assistant turns generated
    tool_calls: int = 0             # tool calls made (parse failures included)
    tool_failures: dict[str, int] = field(default_factory=dict)  # kind (FAILURE_KINDS) -> count
    num_answers: int = 0            # <answer> blocks the model wrote, over all turns
    answer: str | None = None       # the extracted \boxed{} answer, None if there is none
    gold: str = ""                  # the reference answer
    reward: float = 0.0             # 1.0 if the answer is equivalent to the gold answer, else 0.0
    finish_reason: str = ""         # "answer", "no_tool_call", "length" or "max_turns"
    text: str = ""                  # the decoded response, for logs only

    @property
    def num_tool_failures(self) -> int:
        return sum(self.tool_failures.values())
