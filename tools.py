"""The tools a run may offer: each one's function spec, as the system prompt lists it, and its program
for the sandbox; and a tool call as SFT data carries it.

A run offers the tools that --tools names (rollout.add_rollout_flags), by their names in TOOLS. The model
calls one by its spec's function name with JSON arguments (conversation.parse_tool_call reads them and
the tool's program turns them into code and stdin for the sandbox). In SFT data an assistant message
carries its call as "tool_call": tool_call(...), which conversation.render_messages and the chat
template write as the model would. A second tool is one more entry in TOOLS.
"""
from dataclasses import dataclass
from typing import Callable

TOOL_NAME = "execute_python_code_with_standard_io"

_PYTHON_SPEC = {"type": "function", "function": {"name": TOOL_NAME,
    "description": "Execute Python code with standard input and capture standard output. The code runs "
                   "as a script; the input string is given to it on stdin, and whatever it prints to "
                   "stdout is returned. If the code raises an error, the error message is returned "
                   "instead.",
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "The Python code to run."},
        "input": {"type": "string", "description": "The text given to the code on standard input."}},
        "required": ["code", "input"]},
    "return": {"type": "string", "description": "str: The output produced by the executed code through "
               "standard output. If an error occurs during execution, the error message will be "
               "returned."}}}


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: its function schema, as the system prompt lists it, and how a call's
    arguments become a program for the sandbox: program(arguments) -> (code, stdin)."""
    spec: dict
    program: Callable[[dict], tuple[str, str]]  # a missing argument it needs raises KeyError

    @property
    def name(self) -> str:
        """The function name its calls write."""
        return self.spec["function"]["name"]

    @property
    def arguments(self) -> list[str]:
        """The names of its arguments, in the order its spec lists them and its calls write them."""
        return list(self.spec["function"]["parameters"]["properties"])


# The tools a run may offer, by the name --tools takes; a call names a tool by its spec's name. Every
# argument of these tools is a string (conversation.parse_tool_call checks it).
TOOLS = {"python": Tool(_PYTHON_SPEC, lambda args: (args["code"], args.get("input", "")))}
DEFAULT_TOOLS = ("python",)  # the paper's one tool


def tool_call(tool: str, **arguments: str) -> dict:
    """An assistant message's "tool_call" in SFT data: `tool` (a name in TOOLS) called with `arguments`,
    checked against its spec and put in the spec's order. render_messages and the chat template write it
    as the tool's function call. A "tool_call" without "tool" is the Python tool's {"code", "input"}, as
    SFT files written before there were other tools have it. (No tool may name an argument "tool".)"""
    if tool not in TOOLS:
        raise ValueError(f"unknown tool {tool!r}\n---> HINT: a tool call names one of tools.TOOLS: "
                         f"{', '.join(TOOLS)}")
    required = TOOLS[tool].spec["function"]["parameters"].get("required", [])
    if set(arguments) - set(TOOLS[tool].arguments) or set(required) - set(arguments):
        raise ValueError(f"{tool} takes the arguments {', '.join(TOOLS[tool].arguments)}; this call gives "
                         f"{', '.join(arguments) or 'none'}\n---> HINT: give it {', '.join(required)} "
                         f"and no argument its spec does not list")
    return {"tool": tool, **{name: arguments[name] for name in TOOLS[tool].arguments if name in arguments}}


def function_call(call: dict) -> tuple[str, dict]:
    """The function name and the arguments that an assistant message's "tool_call" is written with."""
    if "tool" not in call:  # the Python tool's arguments alone, as older SFT files have them
        call = {"tool": "python", "code": call["code"], "input": call.get("input", "")}
    arguments = tool_call(**call)
    return TOOLS[arguments.pop("tool")].name, arguments
