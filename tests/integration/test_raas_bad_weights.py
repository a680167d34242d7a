"""A RaaS offered weights that do not fit its model (served by a real weight server) reports the
failure, keeps decoding with the version it has, and does not pull that version again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from astraflow.config.recipe import Recipe
from astraflow.protocol.messages import VersionInfo


def test_unfit_weights_are_reported_and_survived(tiny_model: Path) -> None:
    import torch

    from astraflow.roles.raas import RaaS, engine_alive
    from astraflow.roles.raas_sections import RaaSSections
    from astraflow.roles.weight_sync import State
    from astraflow.weights.server import WeightServer
    from astraflow.weights.snapshot import state_dict_to_bytes

    torch.set_num_threads(1)
    recipe = Recipe.model_validate({"policy": [{"name": "main", "model": str(tiny_model)}]})
    client = SimpleNamespace(versions={})
    raas = RaaS(
        client, RaaSSections.of(recipe), policies=[], engine_override=None, slots=1, member_id="raas-t"
    )
    server = WeightServer("127.0.0.1", chunk_bytes=1 << 20, keep_versions=2)
    try:
        bad = {"no.such.parameter": torch.zeros(3, 3)}
        manifest = server.publish("main", 1, state_dict_to_bytes(bad))
        info = VersionInfo(policy="main", version=1, weights_addr=server.address, sha256=manifest.sha256)

        async def go() -> list[int]:
            client.versions = {"main": info}
            raas._maybe_pull_weights()
            await raas.weights.until_settled(30.0)
            assert raas.weights.policies["main"].state is State.REJECTED
            raas._maybe_pull_weights()  # the refused version is not pulled again
            assert not raas.weights.pending()
            done = await raas.clients["main"].generate([1, 2, 3], n=1, max_new_tokens=2)
            return done[0].versions

        versions = asyncio.run(go())
    finally:
        server.close()
        for e in raas.engines.values():
            e.close()
    assert raas.weights.policies["main"].rejected == {(1, server.address)}
    assert "could not apply main version 1" in raas.last_error
    assert versions and set(versions) == {0}  # still decoding with the initial weights
    assert raas.engines["main"].version == 0
    assert not engine_alive(raas.engines["main"])  # closed above: the health check sees a dead decode loop
