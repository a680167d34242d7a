"""A worker-side weight peer in its own process, driven by the transport tests over stdin/stdout.

`shm`: lines "recv VERSION PATH DIGEST" (map and check a slot, hold its lock), "check" (the held
tensors' digest now), "release"; `bcast ADDR TOKEN ID`: join the broadcast and print each version.
Every answer is one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any


def sums(tensors: dict[str, Any]) -> dict[str, str]:
    """sha256 of each tensor's bytes."""
    import torch

    return {
        k: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in tensors.items()
    }


def say(**doc: Any) -> None:
    """One answer line."""
    print(json.dumps(doc), flush=True)


def shm() -> None:
    import torch

    from astraflow.protocol.messages import VersionInfo, WeightOffer
    from astraflow.weights import packed
    from astraflow.weights.transport import SharedTransport

    t = SharedTransport(torch.device("cpu"))
    held = None
    holding = []  # every slot received and not released stays locked
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "recv":
            info = VersionInfo(policy="p", version=int(cmd[1]), weights_addr="")
            offer = WeightOffer(kind="shm", host=t.host, path=cmd[2], digest=cmd[3])
            try:
                held = t.receive(info, offer)
            except Exception as exc:
                say(error=type(exc).__name__)
                continue
            holding.append(held)
            say(version=held.version, sums=sums(held.tensors))
        elif cmd[0] == "check":
            assert held is not None
            buf = torch.cat([v.reshape(-1).view(torch.uint8) for v in held.tensors.values()])
            say(sums=sums(held.tensors), nbytes=int(buf.numel()), digest=packed.digest(buf))
        elif cmd[0] == "release":
            assert held is not None
            held.release()
            holding.remove(held)
            say(released=True)


def bcast(addr: str, token: str, member: str, timeout_s: str = "5", stall_after: str = "0") -> None:
    """Join the broadcast and print each version; with `stall_after` N > 0, stop taking part N
    collectives after it holds version 1 (say {"mid": true}, then hang, holding the next version's
    broadcast mid-transfer until the test kills this process)."""
    import time

    import torch
    import torch.distributed as dist

    from astraflow.weights import broadcast, packed
    from astraflow.weights.broadcast import BroadcastMember

    if int(stall_after) > 0:
        real, calls = broadcast._bcast_all, [0]

        def stalling(pg: Any, chunks: list[Any], timeout_s: float) -> None:
            if m.latest is None or m.latest.version < 1:
                real(pg, chunks, timeout_s)
                return
            for i in range(len(chunks)):
                calls[0] += 1
                if calls[0] == int(stall_after):
                    # the collectives before it (raw: no seal, which the sender has not sent yet),
                    # then nothing more
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    for t in chunks[:i]:
                        pg.broadcast([t], opts).wait()
                    say(mid=True)
                    time.sleep(3600)
            real(pg, chunks, timeout_s)

        broadcast._bcast_all = stalling  # type: ignore[assignment]
    m = BroadcastMember(addr, token, member, torch.device("cpu"), timeout_s=float(timeout_s))
    version = 1
    while True:
        got = m.wait_for(version, 60.0)
        if got is None:
            continue
        assert m.layout is not None
        say(
            version=got.version,
            ok=packed.digest(got.buf) == got.digest,
            sums=sums(packed.views(got.buf, m.layout)),
        )
        version = got.version + 1


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    if sys.argv[1] == "shm":
        shm()
    else:
        bcast(*sys.argv[2:7])
