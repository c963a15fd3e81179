"""ByteTokenizer and load_tokenizer."""

from __future__ import annotations

from disagg.engine.reference.config import load_preset
from disagg.engine.reference.tokenizer import BYTE_OFFSET, ByteTokenizer, load_tokenizer


def test_round_trip_ascii_and_unicode():
    tok = ByteTokenizer()
    for text in ["hello world", "héllo ✓ 日本語 🙂", ""]:
        ids = tok.encode(text)
        assert all(BYTE_OFFSET <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("a", add_bos=True) == [tok.bos_token_id, ord("a") + BYTE_OFFSET]


def test_decode_is_robust_to_non_byte_ids():
    tok = ByteTokenizer()
    ids = [tok.bos_token_id, *tok.encode("ok"), 400, -1, tok.eos_token_id]
    assert tok.decode(ids) == "ok\ufffd\ufffd"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>ok\ufffd\ufffd<eos>"
    half = tok.encode("✓")[:2]  # a cut multi-byte character
    assert tok.decode(half) and set(tok.decode(half)) == {"\ufffd"}


def test_chat_template():
    tok = ByteTokenizer()
    text = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_fits_tiny_preset_and_matches_its_special_ids():
    cfg, tok = load_preset("tiny"), ByteTokenizer()
    assert tok.vocab_size <= cfg.vocab_size
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )


def test_load_tokenizer_falls_back_to_bytes(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
