"""Tokenizers for the MLX backend: GGUF vocabularies through llama.cpp's own tokenizer (loaded
vocabulary-only, no weights), Hugging Face folders through ``tokenizers`` (tokenizer.json)."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localctx.backends.models.chat_template import END_OF_TURN, ChatTemplate, gguf_template_source
from localctx.backends.models.gguf_header import GGUFHeader
from localctx.backends.llamacpp.session import quiet_stderr
from localctx.kvcache.errors import UserError


@dataclass
class Tokenizer:
    encode_fn: object  # str -> list[int] (special tokens parsed, BOS added where the model wants it)
    bytes_fn: object  # int -> bytes
    template: ChatTemplate
    eos: set[int] = field(default_factory=set)
    n_vocab: int = 0
    special: dict[int, str] = field(default_factory=dict)  # control tokens' texts
    plain_encode_fn: object = None  # str -> list[int], no BOS (structured output's tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.encode_fn(text)

    @functools.cached_property
    def guides(self):
        """Structured output's grammars for this vocabulary (backends/generation/guided.Guides)."""
        from localctx.backends.generation.guided import Guides, vocabulary

        return Guides(lambda: vocabulary(self.n_vocab, self.bytes_fn, self.special, self.eos, self.plain_encode_fn))

    def token_bytes(self, token: int) -> bytes:
        return self.bytes_fn(token)


def gguf_tokenizer(path: Path, meta: GGUFHeader) -> Tokenizer:
    """``meta``: the file's header (as loading.load_gguf returns it)."""
    import llama_cpp

    with quiet_stderr():
        vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    eos = {int(eos_id)} if eos_id is not None else {vocab.token_eos()}
    eot_id = meta.get("tokenizer.ggml.eot_token_id")
    if eot_id is not None:
        eos.add(int(eot_id))
    types = np.asarray(meta.get("tokenizer.ggml.token_type", []), dtype=np.int64)
    eos |= {int(i) for i in np.flatnonzero(types == 3) if tokens[int(i)] in END_OF_TURN}  # 3: control token
    name = lambda i: tokens[int(i)] if i is not None and int(i) < len(tokens) else ""  # noqa: E731
    source = gguf_template_source(meta.get("tokenizer.chat_template"))
    template = ChatTemplate(source, bos_token=name(bos_id), eos_token=name(eos_id))
    bos_text = name(bos_id)

    def encode(text: str) -> list[int]:  # a template that writes the BOS itself gets no second one
        bos = add_bos and not (bos_text and text.startswith(bos_text))
        return vocab.tokenize(text.encode("utf-8"), add_bos=bos, special=True)

    return Tokenizer(encode_fn=encode, bytes_fn=lambda tok: vocab.detokenize([tok]), template=template, eos=eos,
                     n_vocab=len(tokens), special={int(i): tokens[int(i)] for i in np.flatnonzero(types == 3)},
                     plain_encode_fn=lambda text: vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False))


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable stand-in character → the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _content(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def folder_tokenizer(folder: Path, cfg: dict) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    file = folder / "tokenizer.json"
    if not file.is_file():
        raise UserError(f"{folder} has no tokenizer.json; add it (from the model's repository) to run it")
    tok = HFTokenizer.from_file(str(file))
    tcfg_file = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_file.read_text()) if tcfg_file.is_file() else {}
    bos, eos_text = _content(tcfg.get("bos_token")), _content(tcfg.get("eos_token"))
    eos = set()
    cfg_eos = cfg.get("eos_token_id")
    for e in (cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]):
        if e is not None:
            eos.add(int(e))
    if eos_text and tok.token_to_id(eos_text) is not None:
        eos.add(tok.token_to_id(eos_text))
    decoder_kind = json.loads(file.read_text()).get("decoder") or {}
    byte_level = decoder_kind.get("type") == "ByteLevel"
    table = _byte_decoder()

    def token_bytes(t: int) -> bytes:
        piece = tok.id_to_token(t) or ""
        if byte_level:
            return bytes(table[c] for c in piece if c in table)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    add_bos = bool(tcfg.get("add_bos_token", False))
    bos_id = tok.token_to_id(bos) if bos else None

    def encode(text: str) -> list[int]:
        ids = tok.encode(text, add_special_tokens=False).ids
        return ([bos_id] + ids) if add_bos and bos_id is not None and ids[:1] != [bos_id] else ids

    template = ChatTemplate(tcfg.get("chat_template"), bos_token=bos, eos_token=eos_text)
    special = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return Tokenizer(encode_fn=encode, bytes_fn=token_bytes, template=template, eos=eos,
                     n_vocab=tok.get_vocab_size(with_added_tokens=True), special=special,
                     plain_encode_fn=lambda text: tok.encode(text, add_special_tokens=False).ids)
