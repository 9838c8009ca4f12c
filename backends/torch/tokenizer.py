"""Tokenizers for the torch backend: from an HF ``tokenizer.json``, or rebuilt from GGUF metadata
with the ``tokenizers`` package so the ids match llama.cpp's: a byte-level BPE (``gpt2``) split
the way llama.cpp's pre-tokenizer for that model does (``tokenizer.ggml.pre``), or a
SentencePiece vocabulary (``llama``: Llama 2, Gemma) as the BPE its scores define."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from localctx.backends.models.chat_template import END_OF_TURN, gguf_template_source
from localctx.kvcache.errors import UserError

_CONTRACTIONS = "'s|'t|'re|'ve|'m|'ll|'d"
_CASELESS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = _CONTRACTIONS + r"| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CASELESS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CASELESS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's split regexes per ``tokenizer.ggml.pre`` (applied one after another)
PRE_SPLITS = {
    "gpt2": [_GPT2], "mpt": [_GPT2], "olmo": [_GPT2],
    "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3], "llama3": [_LLAMA3], "dbrx": [_LLAMA3], "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2], "stablelm2": [_QWEN2],
}
# pre-tokenizers for which llama.cpp looks a whole word up before merging
IGNORE_MERGES = {"llama-bpe", "llama3", "dbrx", "smaug-bpe"}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    bos_id: int | None
    eos_ids: set[int]
    add_bos: bool
    chat_template: str | None
    bos_text: str = ""
    eos_text: str = ""
    control_ids: set[int] = field(default_factory=set)
    byte_level: bool = True

    def __post_init__(self) -> None:
        self._bytes: dict[int, bytes] = {}
        self._byte_decoder = _byte_decoder()
        self._added = set(self.tokenizer.get_added_tokens_decoder())

    def encode(self, text: str) -> list[int]:
        """Special tokens written in the text (e.g. from the chat template) become their ids."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def vocabulary(self):
        """The vocabulary as llguidance reads it (backends/generation/guided.Vocabulary)."""
        from localctx.backends.generation.guided import vocabulary

        special = {i: self.tokenizer.id_to_token(i) or "" for i in self.control_ids}
        return vocabulary(self.tokenizer.get_vocab_size(with_added_tokens=True), self.token_bytes, special,
                          self.eos_ids, lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids)

    @functools.cached_property
    def guides(self):
        """Structured output's grammars for this vocabulary (backends/generation/guided.Guides)."""
        from localctx.backends.generation.guided import Guides

        return Guides(self.vocabulary)

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._piece(token_id)
        return cached

    def _piece(self, token_id: int) -> bytes:
        if token_id in self.control_ids:
            return b""
        text = self.tokenizer.id_to_token(token_id)
        if text is None:
            return b""
        if token_id in self._added:  # added tokens are stored as plain text
            return text.encode()
        if self.byte_level:
            if all(ch in self._byte_decoder for ch in text):
                return bytes(self._byte_decoder[ch] for ch in text)
            return text.encode()
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):  # sentencepiece byte fallback
            return bytes([int(text[3:5], 16)])
        return text.replace("\u2581", " ").encode()

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece merges as BPE merges: llama.cpp joins the adjacent pair whose joined text is
    the highest-scoring token; here every way of splitting a token into two tokens is a merge,
    ranked by the joined token's score (ties: the lower id first)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED, UNUSED, BYTE)}
    ranked = []
    for tok, i in vocab.items():
        if types[i] != NORMAL:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_tokenizer(reader) -> tuple[Tokenizer, list[str], list[int]]:
    tokens = [str(t) for t in reader.get("tokenizer.ggml.tokens")]
    types = [int(t) for t in reader.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    scores = [float(x) for x in reader.get("tokenizer.ggml.scores", [0.0] * len(tokens))]
    unk = reader.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, spm_merges(tokens, scores, types),
                     unk_token=tokens[int(unk)] if unk is not None else None, byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    steps = [normalizers.Replace(" ", SPACE)]
    if reader.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, tokens, types


def _bpe_tokenizer(reader, name: str) -> tuple[Tokenizer, list[str], list[int]]:
    pre = str(reader.get("tokenizer.ggml.pre", "default"))
    splits = PRE_SPLITS.get(pre)
    if splits is None:
        raise UserError(f"{name} uses llama.cpp pre-tokenizer {pre!r}, which the torch backend does not know "
                        f"(known: {', '.join(sorted(PRE_SPLITS))}); use --backend llamacpp")
    tokens = [str(t) for t in reader.get("tokenizer.ggml.tokens")]
    types = [int(t) for t in reader.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    merges = [tuple(str(m).split(" ", 1)) for m in reader.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, tokens, types


def from_gguf(reader, name: str) -> TextTokenizer:
    kind = reader.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok, tokens, types = _bpe_tokenizer(reader, name)
    elif kind == "llama":
        tok, tokens, types = _spm_tokenizer(reader)
    else:
        raise UserError(f"{name} has a {kind!r} tokenizer; the torch backend rebuilds byte-level BPE ('gpt2') "
                        "and SentencePiece ('llama') tokenizers from GGUF. Use --backend llamacpp, or the "
                        "model's HF folder with tokenizer.json")
    special = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    bos = reader.get("tokenizer.ggml.bos_token_id")
    eos = reader.get("tokenizer.ggml.eos_token_id")
    eot = reader.get("tokenizer.ggml.eot_token_id")
    eos_ids = {int(x) for x in (eos, eot) if x is not None}
    eos_ids |= {i for i, t in enumerate(types) if t == CONTROL and tokens[i] in END_OF_TURN}
    return TextTokenizer(
        tokenizer=tok, bos_id=int(bos) if bos is not None else None, eos_ids=eos_ids,
        add_bos=bool(reader.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=gguf_template_source(reader.get("tokenizer.chat_template")),
        bos_text=tokens[int(bos)] if bos is not None else "", eos_text=tokens[int(eos)] if eos is not None else "",
        control_ids={i for i, t in enumerate(types) if t == CONTROL}, byte_level=kind == "gpt2")


def _token_text(value) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def from_hf_folder(folder: Path) -> TextTokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder} has no tokenizer.json; the torch backend needs the fast tokenizer file "
                        "(save it with transformers' save_pretrained) or use a GGUF")
    tok = Tokenizer.from_file(str(path))
    cfg = _read_json(folder / "tokenizer_config.json")
    gen = _read_json(folder / "generation_config.json")
    model_cfg = _read_json(folder / "config.json")
    bos_text, eos_text = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    bos_id = tok.token_to_id(bos_text) if bos_text else None
    eos_ids: set[int] = set()
    for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
        eos_ids.update(source if isinstance(source, list) else [source] if source is not None else [])
    if eos_text and tok.token_to_id(eos_text) is not None:
        eos_ids.add(tok.token_to_id(eos_text))
    decoder = json.loads(path.read_text()).get("decoder") or {}
    byte_level = decoder.get("type") == "ByteLevel"
    added = tok.get_added_tokens_decoder()
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return TextTokenizer(
        tokenizer=tok, bos_id=bos_id, eos_ids={int(e) for e in eos_ids},
        add_bos=bool(cfg.get("add_bos_token", False)), chat_template=template,
        bos_text=bos_text, eos_text=eos_text,
        control_ids={i for i, t in added.items() if t.special}, byte_level=byte_level)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} cannot be read ({exc}); fix or replace it") from None
