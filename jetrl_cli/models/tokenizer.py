"""Tokenizers of Hugging Face model directories (``tokenizer.json``), read with ``tokenizers``.

Special tokens come from the directory's own files: ``eos`` ids from ``generation_config.json``,
``config.json`` and ``tokenizer_config.json`` (all of them stop generation), ``bos`` is added by the
tokenizer's own post-processor exactly as ``transformers`` would. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import JetrlError


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise JetrlError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None


def _token_text(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    def __init__(self, tk, eos_ids: tuple[int, ...], pad_id: int, source: str):
        self._tk = tk
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.source = source

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
        eos: list[int] = []
        for src in (_read_json(p / "generation_config.json"), _read_json(p / "config.json")):
            v = src.get("eos_token_id")
            for i in v if isinstance(v, list) else [v]:
                if isinstance(i, int) and i not in eos:
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

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text).ids

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
