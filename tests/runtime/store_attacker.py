"""Another local process that connects to a moe-ep rendezvous store and forges keys.

Usage: python store_attacker.py HOST PORT MODE SECONDS

It knows moe-ep's barrier protocol (count / arrived / done / abort keys) but not the run
token. For `SECONDS` it lists the store's keys every few milliseconds and, for every key
under `moe_ep/`, writes the protocol key it would forge next to it and one level up:
MODE `done` sets `<prefix>/done`, MODE `abort` sets `<prefix>/abort` to a verdict blaming
rank 1. Prints "ready" once connected, then the number of keys it wrote.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch.distributed as dist

FORGED = {
    "done": b"1",
    "abort": b"rank(s) [1] did not arrive (1/2 did)",
}


def main() -> None:
    host, port, mode, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    value = FORGED[mode]
    end = time.monotonic() + 60
    while True:
        try:
            store = dist.TCPStore(
                host, port, 2, False, datetime.timedelta(seconds=5), wait_for_workers=False
            )
            break
        except Exception:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    print("ready", flush=True)
    written = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key in store.list_keys():
            if not key.startswith("moe_ep/") or key.endswith(("/done", "/abort")):
                continue
            parent = key.rsplit("/", 1)[0]
            for prefix in (parent, parent.rsplit("/", 1)[0]):
                store.set(f"{prefix}/{mode}", value)
                written += 1
        time.sleep(0.005)
    print(written, flush=True)


if __name__ == "__main__":
    main()
