"""Chat templates (Hugging Face's, verbatim) and OpenAI tools for the template tests."""

from __future__ import annotations

from pathlib import Path

# Hugging Face's Meta-Llama-3-8B-Instruct template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

TEMPLATES = Path(__file__).parent / "templates"
QWEN25_TEMPLATE = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()


LLAMA31_TEMPLATE = (TEMPLATES / "llama-3.1-instruct.jinja").read_text()


# Hugging Face's ChatML, and a ChatML with a default system prompt (Qwen1.5's way).
HF_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


DEFAULT_SYSTEM_CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    """An OpenAI tool call: arguments are JSON text."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
