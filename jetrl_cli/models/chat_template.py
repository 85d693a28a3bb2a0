"""A model directory's chat template, rendered as ``transformers``' ``apply_chat_template`` renders it.

The template is read from the directory as its tokenizer reads it (``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template``; else a processor's ``chat_template.json``) and rendered in a
sandboxed Jinja environment with the names Hugging Face templates use: ``messages``,
``add_generation_prompt``, the special tokens as strings (``bos_token``, ``eos_token``, ...:
``tokenizer_config.json``'s, else ``special_tokens_map.json``'s),
``raise_exception``, ``strftime_now``, a ``tojson`` filter that does not escape HTML and the
``{% generation %}`` tag, plus the preset's ``task.chat_template_kwargs`` (e.g. ``enable_thinking: false``).
As ``transformers``, a message's keys whose value is null are left out (a Parquet column of messages gives
every message every key any of them has, null where it has none).
The rendered text is encoded without the tokenizer's own special tokens: the template writes them (as
verl's dataset does: ``apply_chat_template(tokenize=False)``, then ``add_special_tokens=False``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import JetrlError
from ..fileio import read_json
from .tokenizer import _read_json, _token_text

# The named special tokens a template sees as strings (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILES = "chat_template.jinja, tokenizer_config.json's chat_template or chat_template.json"


def _pick(source: str, tpl) -> str:
    """A template, or of several named ones (a dict, or transformers' list of ``{name, template}``) the
    one named ``default``."""
    if isinstance(tpl, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in tpl):
            raise JetrlError(f"{source}: chat_template is a list; each entry must be {{name, template}} strings")
        tpl = {t["name"]: t["template"] for t in tpl}
    if isinstance(tpl, dict):
        if "default" not in tpl or not isinstance(tpl["default"], str):
            raise JetrlError(f"{source}: chat_template holds named templates ({', '.join(map(repr, tpl))}) but no "
                             "'default' one, which jetrl renders")
        return tpl["default"]
    if not isinstance(tpl, str):
        raise JetrlError(f"{source}: chat_template must be a string (a Jinja template), got {type(tpl).__name__}")
    return tpl


class ChatTemplate:
    """One model directory's chat template, compiled once."""

    def __init__(self, text: str, source: str, special_tokens: dict[str, str]):
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise JetrlError("a chat template needs jinja2 (pip install jinja2)") from None
        from datetime import datetime

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        class Generation(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): its body."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.Scope(body).set_lineno(lineno)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.special_tokens = special_tokens
        self._errors = (jinja2.exceptions.TemplateError,)
        try:
            self._tpl = env.from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise JetrlError(f"{source}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ChatTemplate | None":
        """The directory's template, or None when it has none."""
        p = Path(path)
        tcfg_path = p / "tokenizer_config.json"
        tcfg = _read_json(tcfg_path)
        if (p / "chat_template.jinja").exists():
            source = str(p / "chat_template.jinja")
            try:
                text = (p / "chat_template.jinja").read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise JetrlError(f"{source}: cannot read ({e})") from None
        elif tcfg.get("chat_template") is not None:
            source = str(tcfg_path)
            text = _pick(source, tcfg["chat_template"])
        elif (p / "chat_template.json").exists():  # a processor's file: the tokenizer's own come first
            source = str(p / "chat_template.json")
            raw = read_json(p / "chat_template.json")
            if not isinstance(raw, dict) or "chat_template" not in raw:
                raise JetrlError(f"{source}: must be a JSON object with a chat_template key")
            text = _pick(source, raw["chat_template"])
        else:
            return None
        smap = _read_json(p / "special_tokens_map.json")
        special = {}
        for k in SPECIAL_TOKEN_NAMES:  # transformers reads both files: tokenizer_config.json's first here
            t = _token_text(tcfg.get(k))
            t = t if t is not None else _token_text(smap.get(k))
            if t is not None:
                special[k] = t
        return cls(text, source, special)

    def render(self, messages: list[dict], extra: dict | None = None) -> str:
        """The prompt for the model's next (assistant) turn after ``messages``."""
        kwargs = {**self.special_tokens, **(extra or {})}
        # as transformers' apply_chat_template: keys whose value is null are left out of each message
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._tpl.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                    **kwargs)
        except self._errors as e:
            raise JetrlError(f"{self.source}: the chat template refused the prompt: {e}") from None
        except Exception as e:  # noqa: BLE001 -- e.g. a TypeError on a value of the wrong type: the data's or kwargs'
            msg = (str(e).strip().splitlines() or [""])[0][:200]
            raise JetrlError(f"{self.source}: the chat template failed on the prompt ({type(e).__name__}: {msg}); "
                             "check the prompt's messages and task.chat_template_kwargs") from None
