"""Tokenizers of Hugging Face model directories (``tokenizer.json``), read with ``tokenizers``.

Special tokens come from the directory's own files: ``eos`` ids from ``generation_config.json``,
``config.json`` and ``tokenizer_config.json`` (all of them stop generation), ``bos`` is added by the
tokenizer's own post-processor exactly as ``transformers`` would. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import JetrlError
from ..fileio import read_json


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise JetrlError(f"{path}: must be a JSON object, got a {type(raw).__name__}")
    return raw


def _eos_ids(path: Path, src: dict) -> list[int]:
    """``eos_token_id`` of one file: null, an id or a list of ids."""
    v = src.get("eos_token_id")
    ids = [] if v is None else v if isinstance(v, list) else [v]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise JetrlError(f"{path}: eos_token_id is {json.dumps(v)[:60]}; must be a token id (an integer >= 0), "
                         "a list of them, or null")
    return ids


def _check_ids_fit(p: Path, tk, vocab_size, eos_sources: list[tuple[Path, list[int]]]) -> None:
    """Every token id of the tokenizer and every eos id below config.json's ``vocab_size`` (the model's
    embedding rows): a larger one would index past the embedding in the middle of a run."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        return  # no config.json, or a bad vocab_size that reading the model reports
    vocab = tk.get_vocab(with_added_tokens=True)
    if vocab:
        token, top = max(vocab.items(), key=lambda kv: kv[1])
        if top >= vocab_size:
            raise JetrlError(f"{p / 'tokenizer.json'}: token {token!r} has id {top}, but config.json's vocab_size is "
                             f"{vocab_size} (ids must be below it; tokenizer and model do not match)")
    for f, ids in eos_sources:
        bad = [i for i in ids if i >= vocab_size]
        if bad:
            raise JetrlError(f"{f}: eos_token_id {bad[0]} is outside the vocabulary (config.json's vocab_size is "
                             f"{vocab_size}: ids 0..{vocab_size - 1})")


def _token_text(v) -> str | None:
    """A special token's text: a string, or an ``AddedToken``'s ``{"content": ...}``."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    def __init__(self, tk, eos_ids: tuple[int, ...], pad_id: int, source: str):
        self._tk = tk
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.source = source
        self._chat = None  # the directory's chat template, read when first needed

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        p = Path(path)
        f = p / "tokenizer.json"
        if not f.exists():
            raise JetrlError(f"{p}: no tokenizer.json (jetrl reads fast tokenizers; save one with "
                             "transformers: AutoTokenizer.from_pretrained(d).save_pretrained(d))")
        from tokenizers import Tokenizer as _Tk

        try:
            tk = _Tk.from_file(str(f))
        except Exception as e:  # tokenizers raises plain Exceptions for malformed files
            raise JetrlError(f"{f}: cannot read tokenizer ({str(e).splitlines()[0]})") from None
        tcfg = _read_json(p / "tokenizer_config.json")
        gcfg, mcfg = _read_json(p / "generation_config.json"), _read_json(p / "config.json")
        eos_sources = [(p / "generation_config.json", _eos_ids(p / "generation_config.json", gcfg)),
                       (p / "config.json", _eos_ids(p / "config.json", mcfg))]
        _check_ids_fit(p, tk, mcfg.get("vocab_size"), eos_sources)
        eos: list[int] = []
        for _, ids in eos_sources:
            for i in ids:
                if i not in eos:
                    eos.append(i)
        text = _token_text(tcfg.get("eos_token"))
        if text is not None and tk.token_to_id(text) is not None and tk.token_to_id(text) not in eos:
            eos.append(tk.token_to_id(text))
        pad_text = _token_text(tcfg.get("pad_token"))
        pad = tk.token_to_id(pad_text) if pad_text else None
        if pad is None:
            pad = eos[0] if eos else 0
        return cls(tk, tuple(eos), pad, str(p))

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """``text``'s ids; ``special``: with the special tokens the tokenizer's post-processor adds (a BOS),
        as ``transformers``' ``tokenizer(text)`` -- off for text that writes its own (a chat template's)."""
        return self._tk.encode(text, add_special_tokens=special).ids

    @property
    def chat_template(self):
        """The directory's ``ChatTemplate``; a one-line error when it has none."""
        if self._chat is None:
            from .chat_template import TEMPLATE_FILES, ChatTemplate

            self._chat = ChatTemplate.from_dir(self.source)
            if self._chat is None:
                raise JetrlError(f"{self.source}: no chat template ({TEMPLATE_FILES}); the preset puts its prompts "
                                 "in one (task.chat_template, or jsonl prompts given as chat messages)")
        return self._chat

    def encode_prompts(self, problems, chat=None) -> tuple[list[str], list[list[int]]]:
        """The text the model is given for each ``tasks.Problem`` and its ids: the prompt as it is, or with
        ``chat`` (``tasks.ChatSpec``) the conversation rendered by the chat template, encoded without the
        tokenizer's own special tokens (the template writes them)."""
        if chat is None:
            texts = [p.prompt for p in problems]
        else:
            tpl = self.chat_template
            texts = [tpl.render(chat.messages(p), chat.kwargs) for p in problems]
        # one call for all (the tokenizer's threads; the same ids as encode() one by one)
        return texts, [e.ids for e in self._tk.encode_batch(texts, add_special_tokens=chat is None)]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special)

    def token_id(self, text: str) -> int | None:
        return self._tk.token_to_id(text)


def write_char_tokenizer(path: str | Path, alphabet: str) -> None:
    """A character-level tokenizer in HF format (``<pad>``=0, ``<eos>``=1, ``<unk>``=2, then ``alphabet``),
    loadable by ``tokenizers`` and by ``transformers.AutoTokenizer``."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tk

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tk = _Tk(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r".|\n"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(t, special=True) for t in specials])
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tk.save(str(p / "tokenizer.json"))
    (p / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "model_max_length": 1024,
    }, indent=2) + "\n")
