"""The caller's text tools without transformers or torch: a model folder's
``tokenizer.json`` read by the tokenizers library, and its chat template rendered
with jinja2 the way transformers' ``apply_chat_template`` renders it (a sandboxed,
immutable environment with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``
and ``strftime_now`` as globals, and a ``tojson`` filter that keeps non-ASCII text).

Loading takes well under a second, where importing transformers for its
AutoTokenizer took most of ``ferrum-rpc generate``'s time to first token.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an object
    with its ``content``."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A model folder's tokenizer and chat template.

    Attributes:
        backend_tokenizer: the tokenizers library's ``Tokenizer`` (what incremental
            decoding steps with).
        chat_template: the Jinja source of the chat template, or None.
        bos_token, eos_token: the special tokens' text, as the folder names them.
        eos_token_id: the id of ``eos_token`` (None where there is none).
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        self.backend_tokenizer = Backend.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self.backend_tokenizer.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str) -> dict[str, list[int]]:
        """``{"input_ids": ...}`` with the special tokens the tokenizer adds, as a
        transformers tokenizer's call gives them."""
        return {"input_ids": self.encode(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The chat template's text for ``messages``."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return _compiled(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of the rendered template; the template writes its own special
        tokens, so none are added (as transformers tokenizes it)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


@lru_cache(maxsize=8)
def _compiled(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.exceptions import TemplateError

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the model folder ``path`` (tokenizer.json, tokenizer_config.json,
    chat_template.jinja)."""
    return Tokenizer(path)
