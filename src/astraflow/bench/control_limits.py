"""The physical limits `astraflow bench control` prints beside the controller: msgpack messages a
second through a raw ZeroMQ ROUTER, and rows a second SQLite inserts in WAL mode (into a scratch
database of its own, never a run's state.db)."""

from __future__ import annotations

import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from astraflow.bench.control import POLICY
from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode


def zmq_msgpack_rate(seconds: float = 2.0) -> float:
    """Heartbeats/s a raw ZeroMQ ROUTER decodes and answers with msgpack, pipelined from one DEALER."""
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    ack = encode(m.HeartbeatAck(rid=1))

    def serve() -> None:
        while not stop.is_set():
            if router.poll(50):
                while True:
                    try:
                        ident, frame = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    decode(frame)
                    router.send_multipart([ident, ack])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    beat = encode(m.Heartbeat(rid=1, loaded={POLICY: 3}, busy=1, free=1))
    sent = got = 0
    window = 1000
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            while sent - got < window:
                dealer.send(beat)
                sent += 1
            if dealer.poll(1000):
                while True:
                    try:
                        dealer.recv(zmq.NOBLOCK)
                        got += 1
                    except zmq.Again:
                        break
        return got / (time.perf_counter() - t0)
    finally:
        stop.set()
        t.join()
        dealer.close(0)
        router.close(0)
        ctx.term()


def sqlite_rows_rate(rows: int = 100_000, per_txn: int = 512) -> dict[str, float]:
    """Rows/s SQLite (WAL, synchronous=NORMAL as the store runs) inserts: batched and one per transaction."""
    with tempfile.TemporaryDirectory() as tmp:
        db = sqlite3.connect(Path(tmp) / "bench.db", isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, task INTEGER, reward REAL, tokens BLOB)")
        blob = bytes(64)
        t0 = time.perf_counter()
        for start in range(0, rows, per_txn):
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO t (task, reward, tokens) VALUES (?, ?, ?)",
                [(i, 0.5, blob) for i in range(start, min(rows, start + per_txn))],
            )
            db.execute("COMMIT")
        batched = rows / (time.perf_counter() - t0)
        single_n = max(1, rows // 20)
        t0 = time.perf_counter()
        for i in range(single_n):
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO t (task, reward, tokens) VALUES (?, ?, ?)", (i, 0.5, blob))
            db.execute("COMMIT")
        single = single_n / (time.perf_counter() - t0)
        db.close()
    return {"rows_per_s_batched": round(batched), "rows_per_s_one_per_txn": round(single)}
