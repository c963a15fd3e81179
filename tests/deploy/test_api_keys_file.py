"""API keys from a file (a mounted Kubernetes Secret, or a file on every `ray up` node)."""

from __future__ import annotations

import httpx
import pytest

from disagg.api.app import create_app
from disagg.config import HTTPConfig
from tests.helpers import serve_asgi


class _Backend:
    """The smallest GenerationBackend: the auth check runs before any generation."""

    model_name = "m"
    max_model_len = 16
    tokenizer = None

    def stream(self, params):
        raise AssertionError("not reached")

    async def stats(self) -> dict:
        return {}


def test_file_keys_join_inline_keys(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text("# rotated 2026-11\nkey-from-secret-0001\n\n  key-from-secret-0002  \n")
    cfg = HTTPConfig(api_keys=["inline-key"], api_keys_file=str(path)).with_file_keys()
    assert cfg.api_keys == ["inline-key", "key-from-secret-0001", "key-from-secret-0002"]
    assert cfg.api_keys_file is None
    assert HTTPConfig(api_keys=["k"]).with_file_keys().api_keys == ["k"]


@pytest.mark.parametrize("content, error", [(None, "cannot be read"), ("# nothing\n\n", "holds no key")])
def test_a_missing_or_empty_key_file_is_an_error_not_open_access(tmp_path, content, error):
    path = tmp_path / "api-keys"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=error):
        HTTPConfig(api_keys_file=str(path)).with_file_keys()
    with pytest.raises(ValueError, match=error):
        create_app(_Backend(), HTTPConfig(api_keys_file=str(path)))


def test_the_http_app_enforces_file_keys(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text("key-from-secret-0001\n")
    app = create_app(_Backend(), HTTPConfig(api_keys_file=str(path)))
    with serve_asgi(app) as url:
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer key-from-secret-0001"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "m"
