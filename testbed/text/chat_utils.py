"""A conversation to prompt text through the tokenizer's chat template, for the offline LLM and the server alike.
Messages are OpenAI's: `content` a string, None, or a list of content parts, whose text parts are joined by
newlines (any other part, an image say, is refused: this engine reads text only)."""
from __future__ import annotations

from typing import Any

# apply_chat_template's own arguments and what this server refuses (tool calling): never template variables
RESERVED_TEMPLATE_KWARGS = frozenset({"tools", "documents", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "conversation", "return_dict"})


def message_dicts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every content a string (ValueError naming `messages[i].content` when one cannot be)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: give a dict with a 'role' and a 'content', got {m!r}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                                     f"supported, got {kind!r}")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: give a string or a list of text parts, got "
                             f"{type(content).__name__}")
        out.append({**m, "content": content})
    return out


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation (ValueError, with the template's own message, when it cannot render).
    `chat_template_kwargs` reach the template as variables (e.g. enable_thinking); `chat_template` replaces the
    tokenizer's own."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: one starts a new "
                         "assistant message, the other continues the last one")
    if not isinstance(chat_template_kwargs or {}, dict):
        raise ValueError(f"chat_template_kwargs: give a dict of template variables, got {chat_template_kwargs!r}")
    kwargs = dict(chat_template_kwargs or {})
    taken = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise ValueError(f"chat_template_kwargs: {', '.join(taken)} cannot be given as template variables "
                         "(tools and documents are not supported by this server; the others are request fields)")
    try:
        return tokenizer.apply_chat_template(message_dicts(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, chat_template=chat_template,
                                             **kwargs)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja and template errors come in many types
        raise ValueError(f"messages: the chat template cannot render them: {e}") from None
