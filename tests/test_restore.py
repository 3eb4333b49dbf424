"""Restoring on a fresh machine at size: a 2 GiB published checkpoint copied back in the background while
the loop keeps pinging a short systemd watchdog (a synchronous copy inside the launch step would miss it
and get the supervisor SIGABRTed), with progress, then resumed from."""
from __future__ import annotations

import shutil
import socket
import threading
import time

from supervised import attempts, events, fake_recipe, supervise

WATCHDOG_S = 2.0


def test_a_multi_gib_restore_keeps_the_watchdog_alive(tmp_path, monkeypatch):
    recipe = fake_recipe(tmp_path, iterations=20, save_steps=10,
                         extra_env={"FAKE_SHARD_MB": "256"})  # 8 ranks x 256 MiB: a 2 GiB checkpoint
    # Writing 2 GiB logs no step for longer than the 2 s hang_timeout_s of these recipes: a save, not a hang.
    code, _ = supervise(recipe)
    assert code == 0 and not events(tmp_path / "out", "crash"), "the long save was taken for a hang"
    shutil.rmtree(tmp_path / "out")  # a new machine: nothing local, the published copy on persistent storage

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.2)
    pings, done = [], threading.Event()

    def listen() -> None:
        while not done.is_set():
            try:
                msg = sock.recv(4096).decode()
            except TimeoutError:
                continue
            if "WATCHDOG=1" in msg:
                pings.append(time.monotonic())

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", str(int(WATCHDOG_S * 1e6)))
    started = time.monotonic()
    try:
        code, sup = supervise(recipe)  # the same recipe (another hash would be another run's copies)
    finally:
        done.set()
        t.join(5)
        sock.close()
    assert code == 0, sup.exit_reason
    out = tmp_path / "out"
    runs = attempts(out)
    assert runs[0].start_step == 20 and runs[0].resumed_from.endswith("checkpoint-20"), runs[0]
    restored = events(out, "restored")
    assert restored and "checkpoint-20" in restored[0]["message"]
    launched_at = runs[0].started_at
    restore_s = launched_at - min(e["at"] for e in events(out))
    assert restore_s > WATCHDOG_S, f"the restore took {restore_s:.1f} s: too short to test the watchdog"
    during = [p for p in pings if p - started < restore_s + 1]
    gaps = [b - a for a, b in zip([started] + during, during)]
    assert during and max(gaps) < WATCHDOG_S, f"watchdog gaps during the restore: {max(gaps):.2f} s"
    assert not (out / "checkpoint-20-merged").exists(), "only what a resume reads"
