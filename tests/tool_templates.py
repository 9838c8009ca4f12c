"""Chat templates with tools support, written for the tests (not copied from a model): a hermes one
of the Qwen2.5 kind, a Llama-3 JSON one, and one without tools."""

# a hermes template of the Qwen2.5 kind, written here: tools in the system turn, calls and results as tags
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_TEMPLATE = ("{% if tools %}Functions: {{ tools | tojson }}. Answer {\"name\": ..., \"parameters\": ...}\n{% endif %}"
                   "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}<assistant>"
