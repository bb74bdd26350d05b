"""A chat template that renders tools, for the tiny checkpoints (demo/build_tiny.py's, like Qwen2-VL's own, does not):
Qwen2.5(-VL)'s hermes-style tool prompt and history, written from its documented behaviour, around the tiny
template's content rendering (one <|image_pad|> per image)."""

from __future__ import annotations

import shutil
from pathlib import Path

_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
)
_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
    ' XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}<|im_start|>assistant"
    "{% if message['content'] %}\n{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}{% set call = call['function'] %}"
    '\n<tool_call>\n{"name": "{{ call["name"] }}", "arguments": {{ call["arguments"] | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n" + _CONTENT + "<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# NOTE: transformers renders with trim_blocks, which eats a newline right after a tag: such newlines are printed.
TOOLS_CHAT_TEMPLATE = _TEMPLATE.replace("%}\n", "%}{{ '\\n' }}")


def with_tools_template(checkpoint: Path, out: Path) -> Path:
    """A copy of `checkpoint` whose chat template renders tools."""
    shutil.copytree(checkpoint, out)
    (out / "chat_template.jinja").write_text(TOOLS_CHAT_TEMPLATE)
    return out
