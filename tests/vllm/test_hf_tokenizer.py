"""A model directory's own tokenizer through ``transformers`` (installed with the vllm extra):
the server's tokenizer API holds (no special tokens added to prompts, chat templates rendered
to text), and a chat completion over it is served."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from disagg.api.app import create_app
from disagg.engine.reference.tokenizer import load_tokenizer
from disagg.messages import StreamChunk
from tests.helpers import serve_asgi

pytestmark = pytest.mark.vllm

WORDS = ["<s>", "</s>", "<unk>", "hello", "world", "user", "assistant", ":", "\n"]


def _model_dir(tmp_path, template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("template", [None, "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                                            "{% if add_generation_prompt %}assistant :{% endif %}"])
def test_the_tokenizer_api_over_transformers(tmp_path, template):
    tok = load_tokenizer(_model_dir(tmp_path, template))
    assert tok.encode("hello world") == [3, 4]  # the post-processor's <s> is not added
    assert tok.encode("hello", add_bos=True) == [0, 3] and tok.eos_token_id == 1
    assert tok.decode([0, 3, 4]) == "hello world"  # special tokens skipped
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert isinstance(text, str)
    if template is not None:
        assert text.split() == ["user", ":", "hello", "assistant", ":"]


def test_a_chat_completion_with_the_models_tokenizer(tmp_path):
    tok = load_tokenizer(_model_dir(tmp_path, "{% for m in messages %}{{ m['content'] }} {% endfor %}"))

    class Backend:  # the engine side scripted: the tokenizer and HTTP layer are the real ones
        model_name, max_model_len, vocab_size = "m", 64, len(WORDS)
        tokenizer = tok
        prompts: list[list[int]] = []

        async def stream(self, params):
            self.prompts.append(list(params.prompt_token_ids))
            for i, t in enumerate((4, 3)):
                await asyncio.sleep(0)
                yield StreamChunk([t], i == 1, "length" if i == 1 else None, len(params.prompt_token_ids))

        async def stats(self):
            return {}

    backend = Backend()
    with serve_asgi(create_app(backend)) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hello world"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "world hello"
    assert backend.prompts == [[3, 4]]
