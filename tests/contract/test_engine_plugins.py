"""The engine plugins as installed packages: found through the astraflow.engines entry point, with
clear errors for a missing server; the SGLang plugin's update sequence against the FAKE server."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from astraflow import plugins
from astraflow.engines.base import GenerationRequest
from astraflow.errors import AstraflowError
from astraflow.protocol.messages import SamplingParams
from tests.contract.conftest import Models
from tests.contract.fake_sglang import FakeSglangServer


def test_sglang_plugin_is_an_entry_point() -> None:
    sg = pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
    assert plugins.load("engines", "sglang") is sg.SglangEngine


@pytest.mark.vllm
def test_vllm_plugin_is_an_entry_point() -> None:
    if os.environ.get("ASTRAFLOW_REQUIRE_VLLM"):
        import astraflow_vllm.engine as engine
    else:
        engine = pytest.importorskip("astraflow_vllm.engine", reason="astraflow-vllm is not installed")
    assert plugins.load("engines", "vllm") is engine.VllmEngine


def test_sglang_without_a_server_is_a_clear_error(tmp_path: Path) -> None:
    sg = pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
    with pytest.raises(AstraflowError, match="no SGLang server answers"):
        # Port 9 (discard) on loopback: nothing listens there.
        sg.SglangEngine(
            str(tmp_path), sg.SglangEngineConfig(url="http://127.0.0.1:9", weights_dir=str(tmp_path))
        )
    with pytest.raises(AstraflowError, match="address"):
        sg.SglangEngine(str(tmp_path), None)


def test_sglang_update_pauses_updates_flushes_and_continues(models: Models, tmp_path: Path) -> None:
    sg = pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
    server = FakeSglangServer(models.a, max_running_requests=4)
    server.start()
    eng = sg.SglangEngine(str(models.a), sg.SglangEngineConfig(url=server.url, weights_dir=str(tmp_path)))
    try:
        eng.load_weights(1, models.state_dict(1))
        assert eng.wait_version(1, timeout=60)
        update = [c for c in server.calls if c != "/generate" and c != "/get_server_info"]
        assert update == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/flush_cache",
            "/continue_generation",
        ]
        assert server.weight_version == "1"
        (out,) = asyncio.run(
            eng.generate([GenerationRequest(prompt_ids=[1, 5], max_new_tokens=3, sampling=SamplingParams())])
        )
        assert out.versions == [1, 1, 1]
        assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # one weight set on disk at a time
    finally:
        eng.close()
        server.stop()
