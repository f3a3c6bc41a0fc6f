"""`kvflow serve --enable-lora --lora-modules name=path`: the request's `model` selects the
adapter (completions and chat), /v1/models lists adapters with the base model as `parent`,
adapters load and unload at run time (KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=1, from under
--lora-allowed-root), and a bad adapter is a 400 that loads nothing and leaves the server up."""
from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from kvflow.entrypoints.openai.errors import APIError
from kvflow.entrypoints.openai.serving_lora import (LoadLoRAAdapterRequest, LoRAAdapters,
                                                   UnloadLoRAAdapterRequest)
from lora_helpers import write_adapter
from server_helpers import ServerProcess

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    sql = write_adapter(str(root / "sql"), default_model_path, seed=1)
    write_adapter(str(root / "fin"), default_model_path, seed=2, r=4, targets=["q_proj", "v_proj"])
    write_adapter(str(root / "big"), default_model_path, seed=3, r=32)
    write_adapter(str(root / "dora"), default_model_path, seed=4, use_dora=True)
    outside = tmp_path_factory.mktemp("elsewhere")
    write_adapter(str(outside / "x"), default_model_path, seed=5)
    old = os.environ.get("KVFLOW_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        srv = ServerProcess("--enable-lora", "--lora-modules", f"sql={sql}", "--max-loras", "2",
                            "--max-lora-rank", "16", "--lora-allowed-root", str(root),
                            "--max-model-len", "512", "--num-blocks", "64")
    finally:
        if old is None:
            del os.environ["KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"] = old
    yield srv, root, outside
    srv.terminate()


def _complete(url: str, model: str, prompt: str = "The capital of France is") -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=60)


def _models(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}


@pytest.mark.slow
def test_model_field_selects_the_adapter_and_models_lists_it(server):
    srv, _, _ = server
    models = _models(srv.url)
    assert set(models) == {MODEL, "sql"}
    assert models["sql"]["parent"] == MODEL and models["sql"]["root"].endswith("sql")
    base, sql = _complete(srv.url, MODEL), _complete(srv.url, "sql")
    assert base.status_code == sql.status_code == 200
    assert sql.json()["model"] == "sql" and base.json()["model"] == MODEL
    assert sql.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    assert _complete(srv.url, "sql").json()["choices"][0]["text"] == sql.json()["choices"][0]["text"]
    chat = httpx.post(f"{srv.url}/v1/chat/completions", json={
        "model": "sql", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
        "temperature": 0}, timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == "sql"
    missing = _complete(srv.url, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


@pytest.mark.slow
def test_adapters_load_and_unload_at_run_time(server):
    srv, root, _ = server
    r = httpx.post(f"{srv.url}/v1/load_lora_adapter",
                   json={"lora_name": "fin", "lora_path": str(root / "fin")})
    assert r.status_code == 200, r.text
    assert _models(srv.url)["fin"]["parent"] == MODEL
    fin = _complete(srv.url, "fin")
    assert fin.status_code == 200 and fin.json()["model"] == "fin"
    r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "fin"})
    assert r.status_code == 200, r.text
    assert "fin" not in _models(srv.url)
    assert _complete(srv.url, "fin").status_code == 404
    assert httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "fin"}).status_code == 404


@pytest.mark.slow
@pytest.mark.parametrize("name,where,match", [
    ("big", "big", "rank 32 is over max_lora_rank 16"),
    ("dora", "dora", "use_dora"),
    ("ghost", "ghost", "no such folder"),
    ("x", "outside", "outside --lora-allowed-root"),
    ("sql", "fin", "already been loaded"),
    (MODEL, "fin", "already been loaded"),
])
def test_a_bad_adapter_is_a_400_and_the_server_stays_up(server, name, where, match):
    srv, root, outside = server
    path = str(outside / "x") if where == "outside" else str(root / where)
    r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]
    assert set(_models(srv.url)) == {MODEL, "sql"}  # nothing loaded
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert _complete(srv.url, "sql").status_code == 200


@pytest.mark.slow
def test_a_malformed_load_request_is_a_400(server):
    srv, root, _ = server
    for body in ({"lora_name": "a"}, {"lora_name": "a", "lora_path": str(root / "fin"), "x": 1},
                 {"lora_name": "", "lora_path": str(root / "fin")}):
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, (body, r.text)


def test_runtime_loads_need_an_allowed_root(tmp_path):
    import asyncio

    loras = LoRAAdapters([], [MODEL], None)
    with pytest.raises(APIError, match="needs --lora-allowed-root"):
        asyncio.run(loras.load(None, LoadLoRAAdapterRequest(lora_name="a", lora_path=str(tmp_path))))
    inside = LoRAAdapters([], [MODEL], str(tmp_path))
    (tmp_path / "ok").mkdir()
    os.symlink("/etc", tmp_path / "escape")
    assert inside._check_path(str(tmp_path / "ok")) == os.path.realpath(tmp_path / "ok")
    for bad in (str(tmp_path / "escape"), str(tmp_path / ".." / "x"), "/etc"):
        with pytest.raises(APIError, match="outside --lora-allowed-root"):
            inside._check_path(bad)


@pytest.mark.parametrize("allowed", ["0", "1"])
def test_runtime_endpoints_exist_only_when_allowed(monkeypatch, allowed):
    """Without KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=1 the endpoints are absent (404), as in vLLM;
    the start-up adapters are listed either way."""
    import types

    from fastapi.testclient import TestClient

    from kvflow.entrypoints.openai.api_server import build_app
    from kvflow.entrypoints.openai.metrics import ServerMetrics
    from kvflow.entrypoints.openai.server_settings import ServerSettings

    monkeypatch.setenv("KVFLOW_ALLOW_RUNTIME_LORA_UPDATING", allowed)
    from kvflow.config import MultiModalConfig

    engine = types.SimpleNamespace(model_path="/m", max_model_len=512, is_dead=False,
                                   config=types.SimpleNamespace(multimodal_config=MultiModalConfig()))
    settings = ServerSettings(served_model_names=["base"], lora_modules=[("sql", "/a/sql")])
    client = TestClient(build_app(engine, settings, ServerMetrics("base")))
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [("base", None), ("sql", "base")]
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/y"})
    # allowed: refused for want of --lora-allowed-root, before the engine is asked
    assert r.status_code == (400 if allowed == "1" else 404)
    if allowed == "1":
        assert "--lora-allowed-root" in r.json()["error"]["message"]


class _FakeEngine:
    """The engine's two LoRA calls; `remove_lora` can be held open to stand for the core's
    round trip, and refused as the core refuses an adapter that its requests still use."""

    def __init__(self) -> None:
        self.added: list[int] = []
        self.removed: list[int] = []
        self.gate: asyncio.Event | None = None
        self.refuse = False

    async def add_lora(self, lr) -> None:
        self.added.append(lr.lora_int_id)

    async def remove_lora(self, lr) -> bool:
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse:
            raise ValueError(f"LoRA adapter {lr.lora_int_id} is in use by 1 unfinished requests")
        self.removed.append(lr.lora_int_id)
        return True


def test_an_adapter_is_held_from_its_check_to_the_requests_end(tmp_path):
    """A request checked against an adapter holds it until it ends, including the time before
    the core has it (tokenizing): unloading it is a 400 meanwhile, and a request checked before
    an unload (or a reload of the name) is a 404 instead of reaching the core, which would load
    the old adapter again under its old id, unlisted and never unloaded."""
    (tmp_path / "v2").mkdir()
    engine = _FakeEngine()
    loras = LoRAAdapters([("sql", "/a/sql")], [MODEL], str(tmp_path))
    unload = UnloadLoRAAdapterRequest(lora_name="sql")

    async def scenario() -> None:
        old = loras.resolve("sql")
        with loras.in_use(old):
            with loras.in_use(old):  # two requests of one adapter
                pass
            with pytest.raises(APIError, match="in use by 1 unfinished"):
                await loras.unload(engine, unload)
        assert engine.removed == [] and loras.resolve("sql") is old and not loras.in_flight
        stale = loras.resolve("sql")  # checked, then tokenizing while the adapter goes
        await loras.unload(engine, unload)
        assert engine.removed == [old.lora_int_id]
        await loras.load(engine, LoadLoRAAdapterRequest(lora_name="sql", lora_path=str(tmp_path / "v2")))
        new = loras.resolve("sql")
        assert new.lora_int_id != old.lora_int_id
        with pytest.raises(APIError, match="was unloaded") as e:
            with loras.in_use(stale):
                pass
        assert e.value.status == 404 and not loras.in_flight
        with loras.in_use(new):
            assert loras.in_flight == {new.lora_int_id: 1}
        # while the core removes it, the name is gone already: nothing new may reach the core
        engine.gate = asyncio.Event()
        task = asyncio.ensure_future(loras.unload(engine, unload))
        await asyncio.sleep(0)
        with pytest.raises(APIError, match="does not exist"):
            loras.resolve("sql")
        with pytest.raises(APIError, match="was unloaded"):
            with loras.in_use(new):
                pass
        engine.refuse = True  # the core still held a request: the adapter stays served
        engine.gate.set()
        with pytest.raises(APIError, match="in use"):
            await task
        assert loras.resolve("sql") is new

    asyncio.run(scenario())
